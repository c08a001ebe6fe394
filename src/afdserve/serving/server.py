"""Runs the API server: builds the deployment from an ``EngineConfig`` (``afdserve.cluster.build_client``,
the same rule as ``LLM``), wraps it in an ``AsyncEngine`` and serves it with uvicorn, in
the foreground (``serve``) or in a background thread (``BackgroundServer``, for tests and benchmarks).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from afdserve.cluster import build_client, resolve_deployment
from afdserve.config import EngineConfig
from afdserve.errors import ConfigError
from afdserve.model.demo import demo_model_cached, demo_model_dir
from afdserve.serving.app import create_app
from afdserve.serving.async_engine import AsyncEngine
from afdserve.serving.chat import ChatTemplate
from afdserve.serving.tools import ToolConfig


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

    @property
    def tools(self) -> ToolConfig:
        return ToolConfig(self.enable_auto_tool_choice, self.tool_call_parser)


def model_name(cfg: EngineConfig, opts: ServerOptions) -> str:
    return opts.served_model_name or cfg.model or "demo"


def build_app(cfg: EngineConfig, opts: ServerOptions = ServerOptions()) -> FastAPI:
    if opts.max_waiting_requests < 0:
        raise ConfigError(f"invalid max_waiting_requests={opts.max_waiting_requests}: must be >= 0")
    cfg = resolve_deployment(cfg)
    if opts.rebalance_interval_s is not None and cfg.expert_workers == 0:
        raise ConfigError("invalid rebalance_interval_s: the colocated engine (expert_workers=0) has no experts to "
                          "re-place")
    opts.tools.check()
    template = _read_template(opts.chat_template)
    engine = build_client(cfg)
    capacity = cfg.max_num_seqs * cfg.attention_workers + opts.max_waiting_requests
    chat = None
    if template is not None:
        tok = engine.tokenizer
        chat = ChatTemplate(template, tok.bos_token if tok else None, tok.eos_token if tok else None)
    return create_app(AsyncEngine(engine, max_in_flight=capacity, rebalance_interval_s=opts.rebalance_interval_s),
                      model_name(cfg, opts), chat, opts.tools)


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
    return uvicorn.Config(app, log_level=opts.log_level, access_log=opts.access_log, timeout_graceful_shutdown=5,
                          timeout_keep_alive=30)


def serve(cfg: EngineConfig, opts: ServerOptions) -> None:
    """Serves until SIGINT/SIGTERM; then stops the engine and its workers. Says what it is doing on
    stdout (building the demo model, starting the workers, the URL) and logs ``afdserve.*`` at
    ``opts.log_level`` on stderr."""
    show_logs(opts.log_level)
    opts.tools.check()  # the flags fail before anything starts
    _read_template(opts.chat_template)
    sock = bind(opts.host, opts.port)
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
    if cfg.model is None:
        progress("note: the demo model has random weights, so its text is gibberish; serve a real model with "
                 "--model /path/to/hf-folder (Mixtral, Qwen2-MoE, Qwen3-MoE)")
    uvicorn.Server(_config(app, opts)).run(sockets=[sock])


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
    """A server on 127.0.0.1 (a free port) in a background thread: ``with BackgroundServer(app) as url``."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.app = app
        self.sock = bind(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(_config(app, ServerOptions(host=host, log_level=log_level)))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="afdserve-http")

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
        self.sock.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
