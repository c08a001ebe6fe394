"""Deployments as ``EngineClient``s: ``build_client(cfg)`` builds the colocated engine or a cluster
of attention and expert workers, launched as local processes or as Ray actors placed on node groups
by a deployment spec file (Ray is imported only then: ``pip install 'afdserve[ray]'``)."""

from afdserve.cluster.build import build_client, make_launcher, resolve_deployment
from afdserve.cluster.spec import DeploymentSpec, RoleSpec, from_plan, load_deployment

__all__ = ["DeploymentSpec", "RoleSpec", "build_client", "from_plan", "load_deployment", "make_launcher",
           "resolve_deployment"]
