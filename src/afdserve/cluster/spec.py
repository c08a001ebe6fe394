"""Deployment spec files: how many workers of each role, where they run, how they are connected.

A spec is a small TOML file that ``afdserve plan --write-deployment`` writes and ``afdserve serve
--deployment`` (or ``LLM(deployment=...)``) reads. The same file works on the local cluster and on
Ray; placement keys (``resources``, ``labels``, ``num_cpus``, ``strategy``) only matter on Ray::

    micro_batches = 2
    gate = "attention"              # where the router runs: "attention" or "expert" (JANUS)
    strategy = "PACK"               # Ray placement-group strategy: PACK | SPREAD | STRICT_PACK | STRICT_SPREAD

    [attention]
    workers = 1
    num_cpus = 1                    # Ray CPUs reserved per worker
    threads = 1                     # torch threads per worker (default: the engine's num_threads)
    device = "cpu"                  # cpu, cuda or cuda:N (default: the engine's device / expert_device)
    resources = { attention_node = 0.001 }   # Ray resources selecting the attention nodes

    [expert]
    workers = 2
    resources = { expert_node = 0.001 }
    expert_split = [4, 4]           # experts per expert worker (contiguous ranges of expert ids)

Values in the file win over the engine's options of the same meaning (``attention_workers``,
``expert_workers``, ``micro_batches``, ``gate``, ``expert_split``, ``comm_transport``, ``on_expert_loss``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from afdserve.config import OVERFLOW_POLICIES, is_capacity_factor, is_device_name
from afdserve.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
ROLES = ("attention", "expert")
DEFAULT_RESOURCES = {"attention": {"attention_node": 0.001}, "expert": {"expert_node": 0.001}}
_TOP_KEYS = {"micro_batches", "gate", "strategy", "comm_transport", "on_expert_loss", "expert_capacity_factor",
             "on_expert_overflow", "placement_timeout_s", "plan", *ROLES}
_ROLE_KEYS = {"workers", "num_cpus", "threads", "device", "resources", "labels"}


@dataclass
class RoleSpec:
    """The workers of one role and the Ray bundle each of them gets."""

    workers: int
    num_cpus: float = 1.0  # Ray CPUs per worker (the bundle's "CPU"); 0 reserves none
    threads: int | None = None  # torch threads per worker; None: the engine's num_threads
    device: str | None = None  # cpu, cuda or cuda:N per worker; None: the engine's device (expert_device)
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources per worker (node group)
    labels: dict[str, str] = field(default_factory=dict)  # Ray node labels the worker's node must have

    def bundle(self) -> dict[str, float]:
        b = {k: float(v) for k, v in self.resources.items() if v}
        if self.num_cpus:
            b["CPU"] = float(self.num_cpus)
        return b


@dataclass
class DeploymentSpec:
    attention: RoleSpec = field(default_factory=lambda: RoleSpec(1, resources=dict(DEFAULT_RESOURCES["attention"])))
    expert: RoleSpec = field(default_factory=lambda: RoleSpec(1, resources=dict(DEFAULT_RESOURCES["expert"])))
    micro_batches: int = 1
    gate: str = "attention"
    expert_split: list[int] | None = None  # experts per expert worker (the expert placement)
    strategy: str = "PACK"
    comm_transport: str | None = None  # None: leave the engine's (auto: shm within a node, TCP across)
    on_expert_loss: str | None = None  # None: leave the engine's ("wait" | "drop")
    expert_capacity_factor: float | None = None  # None: leave the engine's (afdserve.runtime.dispatch)
    on_expert_overflow: str | None = None  # None: leave the engine's ("second-pass" | "drop")
    placement_timeout_s: float = 120.0  # how long Ray may take to reserve every bundle
    plan: dict[str, Any] = field(default_factory=dict)  # the planner's prediction, for the record (not used)
    source: str = "<spec>"  # where it was read from, for messages

    def __post_init__(self) -> None:
        self.validate()

    # ---- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        def bad(key: str, value: object, why: str) -> ConfigError:
            return ConfigError(f"{self.source}: invalid {key}={value!r}: {why}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        for role in ROLES:
            r: RoleSpec = getattr(self, role)
            if not is_int(r.workers) or r.workers < 1:
                raise bad(f"{role}.workers", r.workers, "must be an integer >= 1")
            if not is_num(r.num_cpus) or r.num_cpus < 0:
                raise bad(f"{role}.num_cpus", r.num_cpus, "must be a number >= 0")
            if r.threads is not None and (not is_int(r.threads) or r.threads < 1):
                raise bad(f"{role}.threads", r.threads, "must be an integer >= 1")
            if r.device is not None and not is_device_name(r.device):
                raise bad(f"{role}.device", r.device, "use 'cpu', 'cuda' or 'cuda:N'")
            if not isinstance(r.resources, dict) or not all(
                    isinstance(k, str) and k and is_num(v) and v >= 0 for k, v in r.resources.items()):
                raise bad(f"{role}.resources", r.resources, "must map resource names to amounts >= 0")
            if "CPU" in r.resources:
                raise bad(f"{role}.resources", r.resources, "give CPUs as num_cpus")
            if not isinstance(r.labels, dict) or not all(
                    isinstance(k, str) and k and isinstance(v, str) for k, v in r.labels.items()):
                raise bad(f"{role}.labels", r.labels, "must map label names to strings")
            if not r.bundle():
                raise bad(f"{role}.num_cpus", r.num_cpus, "a worker must reserve something: num_cpus > 0 or resources")
        if not is_int(self.micro_batches) or self.micro_batches < 1:
            raise bad("micro_batches", self.micro_batches, "must be an integer >= 1")
        if self.gate not in ("attention", "expert"):
            raise bad("gate", self.gate, "use 'attention' or 'expert'")
        if self.strategy not in STRATEGIES:
            raise bad("strategy", self.strategy, f"use one of {', '.join(STRATEGIES)}")
        if self.comm_transport is not None and self.comm_transport not in ("auto", "shm", "tcp", "torch"):
            raise bad("comm_transport", self.comm_transport, "use auto, shm, tcp or torch")
        if self.on_expert_loss is not None and self.on_expert_loss not in ("wait", "drop"):
            raise bad("on_expert_loss", self.on_expert_loss, "use 'wait' or 'drop'")
        f = self.expert_capacity_factor
        if f is not None and not is_capacity_factor(f):
            raise bad("expert_capacity_factor", f, "must be a number > 0")
        if self.on_expert_overflow is not None and self.on_expert_overflow not in OVERFLOW_POLICIES:
            raise bad("on_expert_overflow", self.on_expert_overflow, "use 'drop' or 'second-pass'")
        if not is_num(self.placement_timeout_s) or self.placement_timeout_s <= 0:
            raise bad("placement_timeout_s", self.placement_timeout_s, "must be > 0 seconds")
        if self.expert_split is not None and (
                not isinstance(self.expert_split, list) or len(self.expert_split) != self.expert.workers
                or not all(is_int(n) and n >= 1 for n in self.expert_split)):
            raise bad("expert.expert_split", self.expert_split,
                      f"one count >= 1 per expert worker ({self.expert.workers})")

    # ---- use --------------------------------------------------------------------------------
    def engine_overrides(self) -> dict[str, Any]:
        """The EngineConfig fields this spec decides."""
        out: dict[str, Any] = dict(attention_workers=self.attention.workers, expert_workers=self.expert.workers,
                                   micro_batches=self.micro_batches, gate=self.gate,
                                   expert_split=list(self.expert_split) if self.expert_split else None)
        if self.comm_transport is not None:
            out["comm_transport"] = self.comm_transport
        for name in ("on_expert_loss", "expert_capacity_factor", "on_expert_overflow"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def role(self, name: str) -> RoleSpec:
        if name not in ROLES:
            raise ValueError(f"unknown role {name!r}")
        return getattr(self, name)

    def worker_config(self, role: str, cfg: Any) -> Any:
        """The EngineConfig a worker of ``role`` runs with: this role's threads and device; the spec
        already applied (workers on other machines need not have the file)."""
        r = self.role(role)
        cfg = replace(cfg, deployment=None, num_threads=r.threads if r.threads is not None else cfg.num_threads)
        if r.device is None:
            return cfg
        return replace(cfg, device=r.device) if role == "attention" else replace(cfg, expert_device=r.device)

    @classmethod
    def from_config(cls, cfg: Any) -> "DeploymentSpec":
        """The spec of an EngineConfig without a spec file: its shape, default Ray placement."""
        return cls(attention=RoleSpec(cfg.attention_workers, resources=dict(DEFAULT_RESOURCES["attention"])),
                   expert=RoleSpec(cfg.expert_workers, resources=dict(DEFAULT_RESOURCES["expert"])),
                   micro_batches=cfg.micro_batches, gate=cfg.gate,
                   expert_split=list(cfg.expert_split) if cfg.expert_split else None, source="engine options")

    # ---- files ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<spec>") -> "DeploymentSpec":
        unknown = sorted(set(data) - _TOP_KEYS)
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_TOP_KEYS))}")
        roles: dict[str, RoleSpec] = {}
        split = None
        for role in ROLES:
            t = data.get(role)
            if not isinstance(t, dict):
                raise ConfigError(f"{source}: missing table [{role}] (with at least workers = N)")
            keys = _ROLE_KEYS | ({"expert_split"} if role == "expert" else set())
            unknown = sorted(set(t) - keys)
            if unknown:
                raise ConfigError(f"{source}: unknown key(s) in [{role}]: {', '.join(unknown)}; "
                                  f"known: {', '.join(sorted(keys))}")
            if "workers" not in t:
                raise ConfigError(f"{source}: [{role}] needs workers = N")
            roles[role] = RoleSpec(workers=t["workers"], num_cpus=t.get("num_cpus", 1.0), threads=t.get("threads"),
                                   device=t.get("device"),
                                   resources=dict(t.get("resources", DEFAULT_RESOURCES[role])),
                                   labels=dict(t.get("labels", {})))
            if role == "expert":
                split = t.get("expert_split")
        plan = data.get("plan", {})
        if not isinstance(plan, dict):
            raise ConfigError(f"{source}: [plan] must be a table")
        return cls(attention=roles["attention"], expert=roles["expert"], micro_batches=data.get("micro_batches", 1),
                   gate=data.get("gate", "attention"), expert_split=split, strategy=data.get("strategy", "PACK"),
                   comm_transport=data.get("comm_transport"), on_expert_loss=data.get("on_expert_loss"),
                   expert_capacity_factor=data.get("expert_capacity_factor"),
                   on_expert_overflow=data.get("on_expert_overflow"),
                   placement_timeout_s=data.get("placement_timeout_s", 120.0), plan=plan, source=source)

    def to_toml(self) -> str:
        lines = ["# afdserve deployment spec (afdserve serve --deployment FILE; docs/ray.md)",
                 f"micro_batches = {_toml(self.micro_batches)}",
                 f"gate = {_toml(self.gate)}",
                 f"strategy = {_toml(self.strategy)}",
                 f"placement_timeout_s = {_toml(self.placement_timeout_s)}"]
        if self.comm_transport is not None:
            lines.append(f"comm_transport = {_toml(self.comm_transport)}")
        for name in ("on_expert_loss", "expert_capacity_factor", "on_expert_overflow"):
            if getattr(self, name) is not None:
                lines.append(f"{name} = {_toml(getattr(self, name))}")
        for role in ROLES:
            r = self.role(role)
            lines += ["", f"[{role}]", f"workers = {_toml(r.workers)}", f"num_cpus = {_toml(r.num_cpus)}"]
            if r.threads is not None:
                lines.append(f"threads = {_toml(r.threads)}")
            if r.device is not None:
                lines.append(f"device = {_toml(r.device)}")
            lines.append(f"resources = {_toml(r.resources)}")
            if r.labels:
                lines.append(f"labels = {_toml(r.labels)}")
            if role == "expert" and self.expert_split:
                lines.append(f"expert_split = {_toml(self.expert_split)}")
        if self.plan:
            lines += ["", "[plan]  # the planner's prediction, for the record (serve does not read it)"]
            lines += [f"{_key(k)} = {_toml(v)}" for k, v in self.plan.items() if v is not None]
        return "\n".join(lines) + "\n"

    def write(self, path: str | Path) -> None:
        Path(path).write_text(self.to_toml())


def load_deployment(path: str | Path) -> DeploymentSpec:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read deployment spec {str(p)!r}: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"deployment spec {str(p)!r} is not valid TOML: {e}") from e
    return DeploymentSpec.from_dict(data, source=str(p))


def from_plan(plan: Any, num_experts: int | None = None, micro_batches: int | None = None) -> DeploymentSpec:
    """A spec from the planner's ``Plan``: n_a attention and n_e expert workers, its micro-batches,
    the experts per expert node as the split when they cover the model's experts exactly, and the
    predicted performance under [plan]."""
    split = None
    if num_experts is not None and plan.n_e * plan.experts_per_node == num_experts:
        split = [int(plan.experts_per_node)] * int(plan.n_e)
    record = {k: v for k, v in plan.to_json().items() if isinstance(v, (int, float, str, bool))}
    return DeploymentSpec(attention=RoleSpec(int(plan.n_a), resources=dict(DEFAULT_RESOURCES["attention"])),
                          expert=RoleSpec(int(plan.n_e), resources=dict(DEFAULT_RESOURCES["expert"])),
                          micro_batches=int(micro_batches or plan.micro_batches), expert_split=split, plan=record,
                          source="plan")


def _key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() and k.isascii() else _toml(k)


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_toml(x)}" for k, x in v.items()) + " }" if v else "{}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")
