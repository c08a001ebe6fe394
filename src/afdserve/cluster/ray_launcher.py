"""Attention and expert workers as Ray actors, placed on node groups by a deployment spec.

``ClusterClient(cfg, launch=RayLauncher(cfg, spec))`` runs the very same worker classes
(``afdserve.runtime.worker.run_worker``) inside Ray actors instead of local processes:

* one placement group per deployment, one bundle per worker: ``{"CPU": num_cpus, **resources}`` of
  the worker's role (e.g. ``{"expert_node": 0.001}``) and, optionally, node labels; a spec that can
  never fit the cluster fails before anything is reserved, naming the missing resource;
* each actor connects back to the front end over TCP (``multiprocessing.connection`` with a
  per-deployment key) and serves that control connection exactly like a local worker serves its
  pipe; the front end sees the same ``Launched`` interface;
* the M2N transport is chosen per pair as everywhere (``transport="auto"``), with the Ray node as
  the machine identity: shared memory between actors of one node, TCP between nodes;
* a lost worker is fenced (its actor killed) and its replacement is a new actor in the same bundle
  of the placement group (so on a node of the same kind); workers added by a resize get a placement
  group of their own;
* shutdown stops every worker, kills the actors and removes the placement group.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import dataclass, replace
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Listener
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from afdserve.cluster.placement import Demand, Node, why_unplaceable
from afdserve.cluster.spec import ROLES, DeploymentSpec
from afdserve.errors import WorkerError
from afdserve.cluster.process_launcher import ControlLink
from afdserve.runtime.control import ControlChannel


class WorkerActor:
    """Hosts one attention or expert worker (``ray.remote`` is applied by the launcher)."""

    def __init__(self) -> None:
        import afdserve.runtime.worker  # noqa: F401  (torch and the model code load while the others start)

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "hostname": socket.gethostname()}

    def run(self, spec: Any, address: tuple[str, int], authkey: bytes) -> None:
        """Serves the worker until the front end says stop (or its connection closes)."""
        from afdserve.runtime.worker import run_worker

        ctl = ControlChannel(Client(tuple(address), authkey=authkey))
        try:
            run_worker(spec, ctl)
        finally:
            ctl.close()


@dataclass
class RayLaunched(ControlLink):
    """A worker actor and its control connection: the ``Launched`` interface of the local runtime."""

    name: str
    actor: Any
    ref: Any  # the ObjectRef of the actor's ``run`` call: done when the worker returns or dies
    ctl: ControlChannel
    pid: int
    node_id: str
    node_ip: str
    hostname: str
    dead: bool = False
    remote = True  # front-end messages say where it ran

    def describe(self) -> str:
        return f"pid {self.pid} on node {self.node_ip} ({self.hostname}, Ray node {self.node_id[:12]})"

    def exitcode(self) -> int | None:
        return None  # actors have no exit code; see exit_status

    def exit_status(self) -> str:
        done, _ = ray.wait([self.ref], timeout=0)
        if not done:
            return "control connection lost"
        try:
            ray.get(self.ref)
            return "worker returned"
        except ray.exceptions.RayActorError as e:
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            cause = lines[-1] if lines else type(e).__name__
            return f"Ray actor died: {cause}"
        except Exception as e:  # noqa: BLE001 - report whatever Ray says
            return f"{type(e).__name__}: {e}"

    def wait(self, timeout: float) -> None:
        ray.wait([self.ref], timeout=timeout)

    def kill(self) -> None:
        """Fences the worker: its actor killed (not restarted by Ray), its channel closed."""
        self.dead = True
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # Ray already shut down: its actors are gone with it
            pass
        self.ctl.close()

    def join(self, timeout: float) -> None:
        """The front end has sent ``Shutdown``: wait for the worker to return, then kill the actor."""
        try:
            ray.wait([self.ref], timeout=timeout)
            ray.kill(self.actor, no_restart=True)
            ray.wait([self.ref], timeout=5.0)
        except Exception:  # Ray already shut down: its actors are gone with it
            pass
        self.ctl.close()


class RayLauncher:
    """``launch(spec) -> RayLaunched`` for ``ClusterClient``, plus ``prepare`` (reserve the placement
    group and start every actor at once) and ``close`` (release everything). Launching a worker
    that was launched before (a replacement) starts a new actor in the old one's bundle."""

    remote = True
    can_replace = True

    def __init__(self, cfg: Any, spec: DeploymentSpec | None = None, address: str | None = None,
                 host: str | None = None):
        self.cfg = cfg
        self.spec = spec or DeploymentSpec.from_config(cfg)
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            try:
                ray.init(address=address if address is not None else cfg.ray_address, log_to_driver=True)
            except Exception as e:
                raise WorkerError(f"cannot connect to Ray at {address or cfg.ray_address or 'a local cluster'}: "
                                  f"{type(e).__name__}: {e}") from e
        self.store_host = host or os.environ.get("AFD_FRONTEND_HOST") or ray.util.get_node_ip_address()
        self.pgs: list[Any] = []  # one per prepare() (ClusterClient prepares the whole deployment once)
        self.actors: dict[str, tuple[Any, dict]] = {}  # worker name -> (actor handle, info)
        self.bundles: dict[str, tuple[Any, int, dict]] = {}  # worker name -> (placement group, index, bundle)
        self.launched: set[str] = set()  # workers whose actor ran once (launching again: a replacement)
        self._actor_cls = ray.remote(max_restarts=0)(WorkerActor)
        self._key = secrets.token_bytes(16)
        self._closed = False

    # ---- placement ------------------------------------------------------------------------
    def nodes(self, available: bool = False) -> list[Node]:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        free: dict[str, dict] = {}
        if available:
            from ray._private import state  # per-node free resources (no public API yet)

            free = state.available_resources_per_node()
        return [Node(n["NodeID"], n["NodeManagerAddress"],
                     {k: float(v) for k, v in (free.get(n["NodeID"], {}) if available else n["Resources"]).items()},
                     dict(n.get("Labels") or {})) for n in alive]

    def demands(self, specs: list[Any]) -> list[Demand]:
        out = []
        for role in ROLES:
            count = sum(1 for s in specs if s.role == role)
            if count:
                r = self.spec.role(role)
                out.append(Demand(role, count, r.bundle(), dict(r.labels)))
        return out

    def prepare(self, specs: list[Any]) -> None:
        """Reserves one bundle per worker (failing fast when the cluster can never hold them),
        starts every actor in its bundle and waits until each reports its node."""
        cfg, spec = self.cfg, self.spec
        demands = self.demands(specs)
        why = why_unplaceable(demands, self.nodes(), spec.strategy)
        if why:
            raise WorkerError(f"cannot place the deployment ({spec.source}): {why}")
        bundles = [spec.role(s.role).bundle() for s in specs]
        labels = [dict(spec.role(s.role).labels) for s in specs]
        kw: dict = {"bundle_label_selector": labels} if any(labels) else {}
        try:
            pg = placement_group(bundles, strategy=spec.strategy, name=f"afdserve-{specs[0].group}", **kw)
        except TypeError as e:  # a Ray without label selectors
            raise WorkerError(f"{spec.source}: node labels need a newer Ray ({ray.__version__}): {e}") from e
        except ValueError as e:
            raise WorkerError(f"cannot place the deployment ({spec.source}): {e}") from e
        self.pgs.append(pg)
        ready, _ = ray.wait([pg.ready()], timeout=spec.placement_timeout_s)
        if not ready:
            why = why_unplaceable(demands, self.nodes(available=True), spec.strategy, what="the free resources")
            raise WorkerError(f"the placement group of {len(bundles)} bundles ({spec.source}) was not ready after "
                              f"{spec.placement_timeout_s:g} s: " + (why or "Ray did not reserve it (other jobs or "
                                                                     "placement groups may hold the resources)"))
        calls = {}
        for i, s in enumerate(specs):
            self.bundles[s.name] = (pg, i, bundles[i])
            a = self._start_actor(s)
            self.actors[s.name] = (a, {})
            calls[s.name] = a.info.remote()
        self._await_info(calls)

    def _start_actor(self, s: Any) -> Any:
        pg, i, b = self.bundles[s.name]
        return self._actor_cls.options(
            num_cpus=b.get("CPU", 0), resources={k: v for k, v in b.items() if k != "CPU"},
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            name=f"afdserve-{s.group}-{s.name}").remote()

    def _await_info(self, calls: dict[str, Any]) -> None:
        cfg = self.cfg
        deadline = time.monotonic() + cfg.startup_timeout_s
        for name, ref in calls.items():
            try:
                info = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError as e:
                raise WorkerError(f"the Ray actor of {name} did not start within {cfg.startup_timeout_s:g} s") from e
            except ray.exceptions.RayError as e:
                raise WorkerError(f"the Ray actor of {name} failed to start: {e}") from e
            self.actors[name] = (self.actors[name][0], info)

    # ---- launching ------------------------------------------------------------------------
    def __call__(self, spec: Any) -> RayLaunched:
        if spec.name in self.launched:  # a replacement: the old actor was fenced; a new one in its bundle
            old, _ = self.actors[spec.name]
            try:
                ray.kill(old, no_restart=True)
            except Exception:
                pass
            a = self._start_actor(spec)  # spec.group names the membership epoch: a fresh actor name
            self.actors[spec.name] = (a, {})
            self._await_info({spec.name: a.info.remote()})
        elif spec.name not in self.actors:
            self.prepare([spec])  # launched alone (prepare was not called for the deployment)
        self.launched.add(spec.name)
        actor, info = self.actors[spec.name]
        spec = replace(spec, config=self.spec.worker_config(spec.role, spec.config),
                       comm={**spec.comm, "machine_id": f"ray-node:{info['node_id']}", "host": info["ip"]})
        where = f"{spec.name} (Ray node {info['ip']}, {info['node_id'][:12]})"
        with Listener((self.store_host, 0), family="AF_INET", authkey=self._key) as listener:
            ref = actor.run.remote(spec, listener.address, self._key)
            listener._listener._socket.settimeout(1.0)  # type: ignore[attr-defined]
            deadline = time.monotonic() + self.cfg.startup_timeout_s
            while True:
                try:
                    conn = listener.accept()
                    break
                except (socket.timeout, AuthenticationError, EOFError):  # nothing yet, or not our actor: wait on
                    pass
                except OSError as e:
                    raise WorkerError(f"{where} could not connect back to the front end: {e}") from e
                done, _ = ray.wait([ref], timeout=0)
                if done:
                    try:
                        ray.get(ref)
                        why = "returned without connecting"
                    except Exception as e:  # noqa: BLE001
                        why = f"{type(e).__name__}: {e}"
                    raise WorkerError(f"{where} could not connect back to the front end at "
                                      f"{listener.address}: {why}")
                if time.monotonic() > deadline:
                    raise WorkerError(f"{where} did not connect back to the front end at {listener.address} "
                                      f"within {self.cfg.startup_timeout_s:g} s")
        return RayLaunched(spec.name, actor, ref, ControlChannel(conn), info["pid"], info["node_id"], info["ip"],
                           info["hostname"])

    # ---- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not ray.is_initialized():
            return
        refs = []
        for actor, _ in self.actors.values():  # workers already joined are dead: killing again is harmless
            try:
                ray.kill(actor, no_restart=True)
                refs.append(actor.info.remote())
            except Exception:
                pass
        if refs:  # wait until Ray has seen them die (their calls fail)
            ray.wait(refs, num_returns=len(refs), timeout=10.0)
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self.pgs = []
        if self._owns_ray:
            ray.shutdown()

    def placement(self) -> dict[str, dict]:
        """Where each worker runs: ``{name: {"pid", "node_id", "ip", "hostname"}}``."""
        return {n: dict(info) for n, (_, info) in self.actors.items()}
