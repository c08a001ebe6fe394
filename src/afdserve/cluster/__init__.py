"""Running a deployment beyond one machine: deployment spec files and Ray placement.

``make_launcher(cfg)`` is what ``LocalCluster`` uses when ``cfg.cluster == "ray"`` (or a spec file
gives per-role threads): the same workers, launched as Ray actors on the node groups the spec
names. Ray is imported only then (``pip install 'afdserve[ray]'``).
"""

from __future__ import annotations

from typing import Any

from afdserve.cluster.spec import DeploymentSpec, RoleSpec, from_plan, load_deployment

__all__ = ["DeploymentSpec", "RoleSpec", "load_deployment", "from_plan", "make_launcher", "LocalLauncher"]


class LocalLauncher:
    """Local worker processes with the spec's per-role settings (threads)."""

    def __init__(self, spec: DeploymentSpec):
        self.spec = spec

    def __call__(self, ws: Any) -> Any:
        from dataclasses import replace

        from afdserve.runtime.launcher import spawn_worker

        return spawn_worker(replace(ws, config=self.spec.worker_config(ws.role, ws.config)))


def make_launcher(cfg: Any) -> Any:
    """The launcher for ``cfg``: Ray actors for ``cluster="ray"``, else local processes."""
    spec = load_deployment(cfg.deployment) if cfg.deployment else None
    if cfg.cluster == "ray":
        try:
            import ray  # noqa: F401
        except ImportError as e:
            from afdserve.errors import ConfigError

            raise ConfigError("cluster='ray' needs Ray: pip install 'afdserve[ray]'") from e
        from afdserve.cluster.ray_launcher import RayLauncher

        return RayLauncher(cfg, spec)
    return LocalLauncher(spec) if spec is not None else None
