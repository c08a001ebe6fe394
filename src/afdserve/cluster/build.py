"""Builds the deployment an ``EngineConfig`` describes, as an ``EngineClient``: the colocated engine in
this process (``expert_workers=0`` and one attention worker), or a cluster of worker processes on
this machine, or of Ray actors across machines (``cluster="ray"``)."""

from __future__ import annotations

from dataclasses import replace

from afdserve.cluster.process_launcher import spawn_worker
from afdserve.cluster.spec import load_deployment
from afdserve.config import EngineConfig
from afdserve.engine.builder import build_colocated
from afdserve.engine.client import EngineClient
from afdserve.errors import ConfigError


def resolve_deployment(cfg: EngineConfig) -> EngineConfig:
    """``cfg`` with its deployment spec file's values (workers, micro-batches, gate, expert split,
    threads) applied over it; checked again like any config."""
    if cfg.deployment is None:
        return cfg
    resolved = replace(cfg, **load_deployment(cfg.deployment).engine_overrides())
    resolved.check_workers()
    return resolved


def build_client(cfg: EngineConfig) -> EngineClient:
    cfg = resolve_deployment(cfg)
    if cfg.expert_workers == 0 and cfg.attention_workers == 1:
        return build_colocated(cfg)
    from afdserve.cluster.client import ClusterClient

    return ClusterClient(cfg, make_launcher(cfg))


def make_launcher(cfg: EngineConfig):
    """Ray actors for ``cluster="ray"``; else local processes (with a spec file's per-role settings)."""
    spec = load_deployment(cfg.deployment) if cfg.deployment else None
    if cfg.cluster == "ray":
        try:
            import ray  # noqa: F401  (optional: only a Ray deployment needs it)
        except ImportError as e:
            raise ConfigError("cluster='ray' needs Ray: pip install 'afdserve[ray]'") from e
        from afdserve.cluster.ray_launcher import RayLauncher

        return RayLauncher(cfg, spec)
    if spec is None:
        return spawn_worker
    return lambda ws: spawn_worker(replace(ws, config=spec.worker_config(ws.role, ws.config)))
