"""Can a deployment's bundles be placed on a cluster's nodes, and if not, what is missing?

Pure functions over plain data (no Ray), so that the messages are unit-tested: the Ray launcher
calls :func:`why_unplaceable` with the nodes' total resources before it reserves anything (fail
fast), and with the resources available now when the placement group does not become ready.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_EPS = 1e-6


@dataclass(frozen=True)
class Node:
    node_id: str
    ip: str
    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)

    def matches(self, labels: dict[str, str]) -> bool:
        return all(label_matches(self.labels.get(k), v) for k, v in labels.items())

    def short(self) -> str:
        return f"{self.ip} ({self.node_id[:8]})"


def label_matches(value: str | None, selector: str) -> bool:
    """Ray's label-selector values: ``v``, ``!v``, ``in(a, b)``, ``!in(a, b)``."""
    neg = selector.startswith("!")
    sel = selector[1:] if neg else selector
    if sel.startswith("in(") and sel.endswith(")"):
        hit = value is not None and value in {x.strip() for x in sel[3:-1].split(",")}
    else:
        hit = value == sel
    return hit != neg


@dataclass(frozen=True)
class Demand:
    """``count`` workers of one role, each needing ``bundle`` on a node with ``labels``."""

    role: str
    count: int
    bundle: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)

    def what(self) -> str:
        where = f" on nodes labelled {_fmt(self.labels)}" if self.labels else ""
        return f"{self.count} {self.role} worker{'s' if self.count != 1 else ''}{where}"


def _fmt(d: dict) -> str:
    return "{" + ", ".join(f"{k!r}: {v:g}" if isinstance(v, float) else f"{k!r}: {v!r}" for k, v in d.items()) + "}"


def _hint(key: str, role: str) -> str:
    if key == "CPU":
        return f"add nodes with CPUs or lower [{role}] num_cpus"
    if key == "GPU":
        return "add nodes with GPUs"
    return f"start {role} nodes with `ray start --resources='{json.dumps({key: 1})}'`"


def why_unplaceable(demands: list[Demand], nodes: list[Node], strategy: str = "PACK",
                    what: str = "the cluster") -> str | None:
    """A message naming what is missing when ``demands`` can never be placed on ``nodes`` (as
    given: totals or what is free now), None when they fit (or when the search gives up)."""
    if not nodes:
        return f"{what} has no alive nodes"
    for d in demands:
        cand = [n for n in nodes if n.matches(d.labels)]
        if not cand:
            return (f"no node of {what} has the labels {_fmt(d.labels)} that the {d.role} workers ask for "
                    f"(start {d.role} nodes with `ray start --labels=...`)")
        for key, amount in d.bundle.items():
            have = sum(n.resources.get(key, 0.0) for n in cand)
            need = amount * d.count
            if have <= _EPS:
                return (f"{what} has no {key!r} resource{' on those nodes' if d.labels else ''}, which every "
                        f"{d.role} worker needs ({_fmt(d.bundle)}): {_hint(key, d.role)}")
            if have + _EPS < need:
                return (f"needs {d.count} bundles of {_fmt(d.bundle)} for the {d.what()} ({need:g} {key!r}) "
                        f"but {what} has {have:g} {key!r}")
            most = max(n.resources.get(key, 0.0) for n in cand)
            if most + _EPS < amount:
                return (f"one {d.role} worker needs {amount:g} {key!r} on one node but no node of {what} has more "
                        f"than {most:g} {key!r}")
        if not any(_holds(n.resources, d.bundle) for n in cand):
            return f"no node of {what} has all of one {d.role} worker's bundle {_fmt(d.bundle)} at once"
    keys = sorted({k for d in demands for k in d.bundle})
    for key in keys:  # resources that several roles share (CPU)
        users = [d for d in demands if key in d.bundle]
        if len(users) < 2:
            continue
        need = sum(d.bundle[key] * d.count for d in users)
        have = sum(n.resources.get(key, 0.0) for n in nodes if any(n.matches(d.labels) for d in users))
        if have + _EPS < need:
            parts = " + ".join(f"{d.count} x {d.bundle[key]:g} ({d.role})" for d in users)
            return f"needs {need:g} {key!r} in all ({parts}) but {what} has {have:g} {key!r}"
    total = sum(d.count for d in demands)
    if strategy == "STRICT_SPREAD" and total > len(nodes):
        return f"strategy STRICT_SPREAD needs one node per worker ({total}) but {what} has {len(nodes)} node(s)"
    if strategy == "STRICT_PACK":
        whole: dict[str, float] = {}
        for d in demands:
            for k, v in d.bundle.items():
                whole[k] = whole.get(k, 0.0) + v * d.count
        labels = [d.labels for d in demands]
        if not any(_holds(n.resources, whole) and all(n.matches(lb) for lb in labels) for n in nodes):
            return f"strategy STRICT_PACK needs one node with {_fmt(whole)} but no node of {what} has it"
    fit = _pack(demands, nodes, one_per_node=strategy == "STRICT_SPREAD")
    if fit is False:
        per_node = "; ".join(f"{n.short()}: {_fmt({k: v for k, v in n.resources.items() if not _internal(k)})}"
                             for n in nodes)
        asks = ", ".join(f"{d.what()} x {_fmt(d.bundle)}" for d in demands)
        return f"the workers' bundles ({asks}) do not fit on the nodes of {what} together ({per_node})"
    return None


def _internal(key: str) -> bool:
    return key.startswith("node:") or key in ("memory", "object_store_memory")


def _holds(res: dict[str, float], bundle: dict[str, float]) -> bool:
    return all(res.get(k, 0.0) + _EPS >= v for k, v in bundle.items())


def _pack(demands: list[Demand], nodes: list[Node], one_per_node: bool, budget: int = 200_000) -> bool | None:
    """Exact bin packing by backtracking (identical bundles in non-decreasing node order); None if the
    search runs out of ``budget`` steps."""
    items = [d for d in sorted(demands, key=lambda d: -sum(d.bundle.values())) for _ in range(d.count)]
    free = [dict(n.resources) for n in nodes]
    used = [0] * len(nodes)
    steps = 0

    def place(i: int, start: int) -> bool | None:
        nonlocal steps
        if i == len(items):
            return True
        d = items[i]
        for j in range(start, len(nodes)):
            steps += 1
            if steps > budget:
                return None
            if (one_per_node and used[j]) or not nodes[j].matches(d.labels) or not _holds(free[j], d.bundle):
                continue
            for k, v in d.bundle.items():
                free[j][k] = free[j].get(k, 0.0) - v
            used[j] += 1
            nxt = j if i + 1 < len(items) and items[i + 1] is d else 0
            r = place(i + 1, nxt)
            for k, v in d.bundle.items():
                free[j][k] += v
            used[j] -= 1
            if r is not False:
                return r
        return False

    return place(0, 0)
