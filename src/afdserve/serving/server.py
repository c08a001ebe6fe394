"""Runs the API server: builds the deployment from an ``EngineConfig`` (``afdserve.cluster.build_client``,
the same rule as ``LLM``), wraps it in an ``AsyncEngine`` and serves it with uvicorn, in
the foreground (``serve``) or in a background thread (``BackgroundServer``, for tests and benchmarks).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from afdserve.cluster import build_client, resolve_deployment
from afdserve.config import EngineConfig
from afdserve.errors import ConfigError
from afdserve.serving.app import create_app
from afdserve.serving.async_engine import AsyncEngine


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the --model argument, or "demo" for the demo model
    max_waiting_requests: int = 256  # requests beyond the running capacity that may queue; more get 429
    log_level: str = "info"
    access_log: bool = False
    rebalance_interval_s: float | None = None  # re-plan the expert placement this often (None: on demand only)


def model_name(cfg: EngineConfig, opts: ServerOptions) -> str:
    return opts.served_model_name or cfg.model or "demo"


def build_app(cfg: EngineConfig, opts: ServerOptions = ServerOptions()) -> FastAPI:
    if opts.max_waiting_requests < 0:
        raise ConfigError(f"invalid max_waiting_requests={opts.max_waiting_requests}: must be >= 0")
    cfg = resolve_deployment(cfg)
    if opts.rebalance_interval_s is not None and cfg.expert_workers == 0:
        raise ConfigError("invalid rebalance_interval_s: the colocated engine (expert_workers=0) has no experts to "
                          "re-place")
    engine = build_client(cfg)
    capacity = cfg.max_num_seqs * cfg.attention_workers + opts.max_waiting_requests
    return create_app(AsyncEngine(engine, max_in_flight=capacity, rebalance_interval_s=opts.rebalance_interval_s),
                      model_name(cfg, opts))


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
    """Serves until SIGINT/SIGTERM; then stops the engine and its workers."""
    sock = bind(opts.host, opts.port)
    app = build_app(cfg, opts)
    print(f"afdserve: serving model {model_name(cfg, opts)!r} on http://{opts.host}:{sock.getsockname()[1]}/v1",
          flush=True)
    uvicorn.Server(_config(app, opts)).run(sockets=[sock])


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
