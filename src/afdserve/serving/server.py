"""Runs the API server: builds the deployment from an ``EngineConfig`` (``afdserve.cluster.build_client``,
the same rule as ``LLM``), wraps it in an ``AsyncEngine`` and serves it with uvicorn, in
the foreground (``serve``) or in a background thread (``BackgroundServer``, for tests and benchmarks).
With ``admin_port`` the admin endpoints get a second listener on 127.0.0.1, in the same event loop.

On SIGINT/SIGTERM (``serve``) or ``stop`` the server stops listening, gives the requests in flight
``shutdown_grace_s`` to finish, ends the rest (a stream gets an error event and ``[DONE]``), then
stops the engine and its workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import uvicorn
from fastapi import FastAPI

from afdserve.cluster import build_client, resolve_deployment
from afdserve.config import MAX_POOL_WORKERS, EngineConfig
from afdserve.errors import AfdServeError, ConfigError
from afdserve.model.config import ModelConfig
from afdserve.model.demo import demo_model_cached, demo_model_dir
from afdserve.planner import load_model_spec, load_profile
from afdserve.planner.autoscale import AutoscaleConfig, AutoscalePolicy
from afdserve.planner.pool_model import LocalPoolModel
from afdserve.planner.search_config import DEFAULT_SEQ_LEN
from afdserve.serving.admin import create_admin_app
from afdserve.serving.app import HEALTH_TIMEOUT_S, create_app
from afdserve.serving.async_engine import AsyncEngine
from afdserve.serving.autoscaler import Autoscaler
from afdserve.serving.chat import ChatTemplate
from afdserve.serving.edge import DEFAULT_MAX_BODY_BYTES
from afdserve.serving.jobs import JobOptions
from afdserve.serving.tools import ToolConfig

ADMIN_HOST = "127.0.0.1"


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the --model argument, or "demo" for the demo model
    max_waiting_requests: int = 256  # requests beyond the running capacity that may queue; more get 429
    log_level: str = "info"
    access_log: bool = False
    rebalance_interval_s: float | None = None  # re-plan the expert placement this often (None: on demand only)
    chat_template: str | None = None  # a Jinja chat template file (default: the tokenizer's)
    enable_auto_tool_choice: bool = False  # tool_choice "auto": parse tool calls out of the output
    tool_call_parser: str | None = None  # how (afdserve.serving.tool_parsers.TOOL_PARSERS)
    admin_token: str | None = None  # admin endpoints on the public port, behind "Authorization: Bearer <token>"
    admin_port: int | None = None  # admin endpoints on 127.0.0.1:admin_port instead (0: any free port)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413
    shutdown_grace_s: float = 5.0  # on shutdown, requests in flight get this long before they are ended
    health_timeout_s: float = HEALTH_TIMEOUT_S  # /health fails when the engine loop is stuck this long
    job_ttl_s: float = JobOptions.ttl_s  # a finished job's result is kept this long (POST /v1/jobs)
    max_jobs: int = JobOptions.max_jobs  # jobs kept at once; more get 429
    autoscale: AutoscaleConfig | None = None  # resize the pools by this policy (serving.autoscaler)
    autoscale_interval_s: float = 1.0  # sample the signals this often
    autoscale_timeline: str | None = None  # append every sample and decision here (JSON lines)
    autoscale_profile: str | None = None  # a profile of this machine: the policy predicts with the local model

    @property
    def jobs(self) -> JobOptions:
        return JobOptions(self.job_ttl_s, self.max_jobs)

    @property
    def tools(self) -> ToolConfig:
        return ToolConfig(self.enable_auto_tool_choice, self.tool_call_parser)


def model_name(cfg: EngineConfig, opts: ServerOptions) -> str:
    return opts.served_model_name or cfg.model or "demo"


def build_app(cfg: EngineConfig, opts: ServerOptions = ServerOptions()) -> FastAPI:
    """The public app; with ``opts.admin_port`` the admin app is ``app.state.admin_app``."""
    check_options(opts)
    cfg = resolve_deployment(cfg)
    if opts.rebalance_interval_s is not None and cfg.expert_workers == 0:
        raise ConfigError("invalid rebalance_interval_s: the colocated engine (expert_workers=0) has no experts to "
                          "re-place")
    opts.tools.check()
    template = _read_template(opts.chat_template)
    experts = _num_experts(cfg)
    policy = _autoscale_policy(cfg, opts, experts)
    engine = build_client(cfg)
    capacity = cfg.max_num_seqs * cfg.attention_workers + opts.max_waiting_requests
    chat = None
    if template is not None:
        tok = engine.tokenizer
        chat = ChatTemplate(template, tok.bos_token if tok else None, tok.eos_token if tok else None)
    async_engine = AsyncEngine(engine, max_in_flight=capacity, rebalance_interval_s=opts.rebalance_interval_s)
    separate = opts.admin_port is not None  # the admin endpoints on their own listener, not on the public app
    app = create_app(async_engine, model_name(cfg, opts), chat, opts.tools, num_experts=experts,
                     admin_token=None if separate else opts.admin_token, max_body_bytes=opts.max_body_bytes,
                     health_timeout_s=opts.health_timeout_s, jobs=opts.jobs)
    app.state.admin_app = create_admin_app(async_engine, experts, opts.admin_token,
                                           opts.max_body_bytes) if separate else None
    app.state.autoscaler = None
    if policy is not None:
        if not getattr(engine, "can_replace", False):
            engine.shutdown()
            raise ConfigError("--autoscale: this deployment cannot start workers while it serves (its launcher "
                              "cannot replace them)")
        app.state.autoscaler = Autoscaler(async_engine, app.state.metrics, policy,
                                          interval_s=opts.autoscale_interval_s,
                                          timeline_path=opts.autoscale_timeline)
    return app


def _autoscale_policy(cfg: EngineConfig, opts: ServerOptions, num_experts: int | None) -> AutoscalePolicy | None:
    """The autoscaling policy at the deployment's starting sizes (ConfigError when they are outside its
    bounds, the bounds outside what the model allows, or the deployment colocated)."""
    a = opts.autoscale
    if a is None:
        return None
    if cfg.expert_workers == 0:
        raise ConfigError("--autoscale needs a disaggregated deployment (expert_workers >= 1): the colocated "
                          "engine has no pools to resize")
    if a.attention_sizes[-1] > MAX_POOL_WORKERS or (num_experts is not None and a.expert_sizes[-1] > num_experts):
        raise ConfigError(f"invalid autoscaling bounds: at most {MAX_POOL_WORKERS} attention workers and "
                          f"{num_experts} expert workers (the model's experts)")
    if not opts.autoscale_interval_s > 0:
        raise ConfigError(f"invalid autoscale_interval_s={opts.autoscale_interval_s}: must be > 0")
    model = None
    if opts.autoscale_profile is not None:
        try:
            spec = load_model_spec(cfg.model or str(demo_model_dir()))
            max_len = cfg.max_model_len or spec.max_position_embeddings
            model = LocalPoolModel(load_profile(opts.autoscale_profile), spec, cfg.micro_batches, cfg.max_num_seqs,
                                   min(DEFAULT_SEQ_LEN, max_len), a.slo_tpot_s)
        except ValueError as e:
            raise ConfigError(f"--autoscale-profile {opts.autoscale_profile}: {e}") from e
    return AutoscalePolicy(a, cfg.attention_workers, cfg.expert_workers, model=model)


def check_options(opts: ServerOptions) -> None:
    if opts.max_waiting_requests < 0:
        raise ConfigError(f"invalid max_waiting_requests={opts.max_waiting_requests}: must be >= 0")
    if opts.admin_token is not None and not re.fullmatch(r"[\x21-\x7e]{1,4096}", opts.admin_token):
        raise ConfigError("invalid admin token: it must be 1 to 4096 printable ASCII characters without spaces")
    if opts.admin_port is not None and not 0 <= opts.admin_port <= 65535:
        raise ConfigError(f"invalid admin_port={opts.admin_port}: must be in 0..65535")
    if opts.max_body_bytes < 1024:
        raise ConfigError(f"invalid max_body_bytes={opts.max_body_bytes}: must be >= 1024")
    if opts.shutdown_grace_s < 0 or opts.health_timeout_s <= 0:
        raise ConfigError("invalid shutdown_grace_s / health_timeout_s: must be >= 0 / > 0")
    opts.jobs.check()


def _num_experts(cfg: EngineConfig) -> int | None:
    """The model's experts (the most slots an expert worker can use), or None if unknown."""
    try:
        return ModelConfig.from_pretrained(cfg.model or demo_model_dir()).num_experts
    except (AfdServeError, OSError, ValueError, KeyError):
        return None


def _read_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        text = Path(path).read_text()
        ChatTemplate(text)  # fails now, not after the workers started
    except OSError as e:
        raise ConfigError(f"cannot read the chat template {path}: {e.strerror or e}") from e
    except Exception as e:  # a Jinja syntax error
        raise ConfigError(f"invalid chat template {path}: {e}") from e
    return text


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (bound before the deployment starts, so a busy port fails fast)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.set_inheritable(True)
    return sock


def _config(app: FastAPI, opts: ServerOptions) -> uvicorn.Config:
    # uvicorn's grace comes after ours: by then every stream has ended, this is for sending their last events
    return uvicorn.Config(app, log_level=opts.log_level, access_log=opts.access_log, timeout_keep_alive=30,
                          timeout_graceful_shutdown=5)


class _Server(uvicorn.Server):
    """uvicorn's server whose shutdown first stops listening, drains the engine (``AsyncEngine.drain``)
    and stops ``peers`` (the admin listener); only the main one handles signals."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine | None = None, grace_s: float = 0.0,
                 peers: tuple[uvicorn.Server, ...] = (), signals: bool = True):
        super().__init__(config)
        self.engine, self.grace_s, self.peers, self.signals = engine, grace_s, peers, signals

    def capture_signals(self) -> Any:
        return super().capture_signals() if self.signals else contextlib.nullcontext()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for peer in self.peers:
            peer.should_exit = True
        for server in getattr(self, "servers", []):
            server.close()  # no new connections while the requests in flight finish
        if self.engine is not None:
            await self.engine.drain(self.grace_s, lambda: self.force_exit)  # a second Ctrl+C: at once
        await super().shutdown(sockets)


def _servers(app: FastAPI, opts: ServerOptions, sock: socket.socket,
             admin_sock: socket.socket | None) -> Iterator[tuple[uvicorn.Server, socket.socket]]:
    admin = None
    admin_app = getattr(app.state, "admin_app", None)
    if admin_sock is not None and admin_app is not None:
        admin = _Server(_config(admin_app, opts), signals=False)
    yield _Server(_config(app, opts), app.state.engine, opts.shutdown_grace_s, (admin,) if admin else ()), sock
    if admin is not None:
        yield admin, admin_sock  # type: ignore[misc]


def _run(servers: list[tuple[uvicorn.Server, socket.socket]]) -> None:
    """Serves until the first server exits (it stops the others), in a new event loop."""
    async def serve_all() -> None:
        await asyncio.gather(*(server.serve(sockets=[sock]) for server, sock in servers))

    if not hasattr(asyncio, "Runner"):  # Python 3.10: the default loop
        asyncio.run(serve_all())
        return
    with asyncio.Runner(loop_factory=servers[0][0].config.get_loop_factory()) as runner:
        runner.run(serve_all())


def serve(cfg: EngineConfig, opts: ServerOptions) -> None:
    """Serves until SIGINT/SIGTERM; then stops the engine and its workers. Says what it is doing on
    stdout (building the demo model, starting the workers, the URL) and logs ``afdserve.*`` at
    ``opts.log_level`` on stderr."""
    show_logs(opts.log_level)
    check_options(opts)  # the flags fail before anything starts
    opts.tools.check()
    _read_template(opts.chat_template)
    sock = bind(opts.host, opts.port)
    admin_sock = bind(ADMIN_HOST, opts.admin_port) if opts.admin_port is not None else None
    cfg = resolve_deployment(cfg)
    if cfg.model is None and not demo_model_cached():
        progress(f"building the demo model (first run: random weights, ~140 MB) into {demo_model_dir()}...")
    t0 = time.monotonic()
    if cfg.expert_workers == 0 and cfg.attention_workers == 1:
        progress(f"loading {cfg.model or 'the demo model'} (colocated: attention and experts in this process)...")
    else:
        progress(f"starting {cfg.attention_workers} attention + {cfg.expert_workers} expert worker processes "
                 f"({cfg.cluster}); each loads its part of {cfg.model or 'the demo model'}...")
    app = build_app(cfg, opts)
    progress(f"ready in {time.monotonic() - t0:.0f} s: serving model {model_name(cfg, opts)!r}, listening at "
             f"http://{opts.host}:{sock.getsockname()[1]}/v1")
    a = opts.autoscale
    if a is not None:
        progress(f"autoscaling: attention {a.attention_sizes[0]}..{a.attention_sizes[-1]}, experts "
                 f"{a.expert_sizes[0]}..{a.expert_sizes[-1]} workers, TPOT SLO {a.slo_tpot_s * 1e3:g} ms"
                 + (f", TTFT SLO {a.slo_ttft_s * 1e3:g} ms" if a.slo_ttft_s else "")
                 + f"; window {a.window_s:g} s, cool-down {a.cooldown_s:g} s")
    if admin_sock is not None:
        progress(f"admin endpoints at http://{ADMIN_HOST}:{admin_sock.getsockname()[1]}/admin")
    elif opts.admin_token:
        progress("admin endpoints at /admin (Authorization: Bearer <admin token>)")
    if cfg.model is None:
        progress("note: the demo model has random weights, so its text is gibberish; serve a real model with "
                 "--model /path/to/hf-folder (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, gpt-oss)")
    _run(list(_servers(app, opts, sock, admin_sock)))


def progress(message: str) -> None:
    print(f"afdserve: {message}", flush=True)


def show_logs(level: str = "info") -> None:
    """Sends the ``afdserve`` loggers' records (e.g. each worker that becomes ready) to stderr."""
    log = logging.getLogger("afdserve")
    log.setLevel(level.upper())
    if not any(getattr(h, "afdserve", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("afdserve: %(message)s"))
        handler.afdserve = True  # type: ignore[attr-defined]
        log.addHandler(handler)
        log.propagate = False


class BackgroundServer:
    """A server on 127.0.0.1 (a free port) in a background thread: ``with BackgroundServer(app) as url``;
    an app built with ``admin_port`` also gets its admin listener (``admin_url``; port 0: a free one)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 admin_port: int = 0, shutdown_grace_s: float = 5.0):
        self.app = app
        self.sock = bind(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        admin = getattr(app.state, "admin_app", None)
        self.admin_sock = bind(ADMIN_HOST, admin_port) if admin is not None else None
        self.admin_url = f"http://{ADMIN_HOST}:{self.admin_sock.getsockname()[1]}" if self.admin_sock else None
        opts = ServerOptions(host=host, log_level=log_level, shutdown_grace_s=shutdown_grace_s)
        self.servers = list(_servers(app, opts, self.sock, self.admin_sock))
        self.server = self.servers[0][0]
        self.thread = threading.Thread(target=_run, args=(self.servers,), daemon=True, name="afdserve-http")

    def start(self, timeout: float = 60.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self.url

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        for sock in (self.sock, self.admin_sock):
            if sock is not None:
                sock.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
