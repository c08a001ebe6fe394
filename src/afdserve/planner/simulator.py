"""Discrete-event simulation of the ping-pong pipeline (MegaScale-Infer §4.1, Figure 4).

``n_a`` attention nodes and ``n_e`` expert nodes decode one token for every sequence of a global
batch split into ``m`` micro-batches, through ``L`` layers.  Per micro-batch and layer:

1. every attention node runs attention on its share of micro-batch ``j`` (``Ta``);
2. when all attention nodes are done, the tokens reach each expert node after ``Tc`` (A2E);
3. every expert node runs its experts (``Te``), and when all are done the results reach the
   attention nodes after ``Tc`` (E2A), which then start layer ``l+1`` of micro-batch ``j``.

Each node executes one task at a time, first-come first-served by arrival time (ties: lower layer,
then lower micro-batch).  Communication is a pure delay (the M2N library runs on the CPU/NIC and
does not occupy the GPU).  Options: per-micro-batch times, multiplicative log-normal jitter on
compute and/or communication, and a relative load per expert node (expert skew) or attention node.

Where Eq. (5)'s assumptions hold (constant times, balanced loads, ``m*Tf >= 2*(Tf + Tc)``) the
simulated iteration time equals Eq. (5); in general it equals
:func:`afdserve.planner.perf_model.iteration_time` for constant times.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from afdserve.planner.events import EventQueue

__all__ = ["SimConfig", "SimResult", "simulate", "zipf_load"]


@dataclass(frozen=True)
class SimConfig:
    """Inputs of one simulated decoding iteration (times in seconds).

    ``ta``/``te``: compute time of one micro-batch on one node -- a number, or one number per
    micro-batch.  ``te_fixed``: the part of ``te`` that does not scale with load (``k4``); an expert
    node with relative load ``w`` takes ``te_fixed + (te - te_fixed) * w``.  Same for attention
    with ``ta_fixed`` / ``attention_load``.  Loads are normalised to mean 1.
    """

    n_a: int
    n_e: int
    micro_batches: int
    num_layers: int
    ta: float | Sequence[float]
    te: float | Sequence[float]
    tc: float
    tc_back: float | None = None  # E2A time if different from A2E
    ta_fixed: float = 0.0
    te_fixed: float = 0.0
    expert_load: Sequence[float] | None = None
    attention_load: Sequence[float] | None = None
    jitter_cv: float = 0.0  # coefficient of variation of compute times
    comm_jitter_cv: float = 0.0
    seed: int = 0
    tokens: float | None = None  # global batch B (for throughput); default n_a * m

    def __post_init__(self) -> None:
        if min(self.n_a, self.n_e, self.micro_batches, self.num_layers) < 1:
            raise ValueError("n_a, n_e, micro_batches and num_layers must be >= 1")
        for name, seq, n in (("ta", self.ta, self.micro_batches), ("te", self.te, self.micro_batches)):
            if not isinstance(seq, (int, float)) and len(seq) != n:
                raise ValueError(f"{name} must be a number or one value per micro-batch")
        if self.expert_load is not None and len(self.expert_load) != self.n_e:
            raise ValueError("expert_load needs one value per expert node")
        if self.attention_load is not None and len(self.attention_load) != self.n_a:
            raise ValueError("attention_load needs one value per attention node")


@dataclass(frozen=True)
class SimResult:
    iteration_time: float
    throughput: float  # tokens / s
    attention_util: tuple[float, ...]  # busy fraction of each attention node
    expert_util: tuple[float, ...]
    micro_batch_finish: tuple[float, ...]  # when each micro-batch's last layer returned
    events: int

    @property
    def mean_attention_util(self) -> float:
        return sum(self.attention_util) / len(self.attention_util)

    @property
    def mean_expert_util(self) -> float:
        return sum(self.expert_util) / len(self.expert_util)


def zipf_load(n: int, s: float) -> list[float]:
    """Relative loads ``~ 1/rank^s`` normalised to mean 1 (``s = 0``: balanced)."""
    w = [1.0 / (i + 1) ** s for i in range(n)]
    mean = sum(w) / n
    return [x / mean for x in w]


def _normalised(load: Sequence[float] | None, n: int) -> list[float]:
    if load is None:
        return [1.0] * n
    mean = sum(load) / n
    if mean <= 0:
        raise ValueError("loads must have a positive mean")
    return [x / mean for x in load]


def _per_mb(v: float | Sequence[float], m: int) -> list[float]:
    return [float(v)] * m if isinstance(v, (int, float)) else [float(x) for x in v]


class _Jitter:
    def __init__(self, cv: float, rng: random.Random) -> None:
        self.rng = rng
        # log-normal with mean 1 and the requested coefficient of variation
        self.sigma = math.sqrt(math.log(1.0 + cv * cv)) if cv > 0 else 0.0

    def __call__(self, x: float) -> float:
        if self.sigma == 0.0:
            return x
        return x * self.rng.lognormvariate(-0.5 * self.sigma * self.sigma, self.sigma)


def simulate(cfg: SimConfig) -> SimResult:
    m, L, n_a, n_e = cfg.micro_batches, cfg.num_layers, cfg.n_a, cfg.n_e
    rng = random.Random(cfg.seed)
    jit = _Jitter(cfg.jitter_cv, rng)
    cjit = _Jitter(cfg.comm_jitter_cv, rng)
    ta, te = _per_mb(cfg.ta, m), _per_mb(cfg.te, m)
    a_load, e_load = _normalised(cfg.attention_load, n_a), _normalised(cfg.expert_load, n_e)
    tc_fwd = cfg.tc
    tc_back = cfg.tc if cfg.tc_back is None else cfg.tc_back

    # nodes 0..n_a-1 are attention, n_a..n_a+n_e-1 experts; a node's tasks start first-come
    # first-served by arrival time (ties: lower layer, then lower micro-batch)
    n_nodes = n_a + n_e
    busy_time = [0.0] * n_nodes
    tasks: list[EventQueue[tuple[int, int]]] = [EventQueue() for _ in range(n_nodes)]  # (layer, mb)
    running = [False] * n_nodes
    remaining: dict[tuple[str, int, int], int] = {}
    last_done: dict[tuple[str, int, int], float] = {}
    finish = [0.0] * m

    def duration(node: int, layer: int, mb: int) -> float:
        if node < n_a:
            base, fixed, w = ta[mb], cfg.ta_fixed, a_load[node]
        else:
            base, fixed, w = te[mb], cfg.te_fixed, e_load[node - n_a]
        return jit(fixed + (base - fixed) * w)

    ARRIVE, DONE = 0, 1  # at equal times arrivals first
    events: EventQueue[tuple[int, int, int, int]] = EventQueue()  # (kind, node, layer, mb)

    def push(t: float, kind: int, node: int, layer: int, mb: int) -> None:
        events.push(t, (kind, node, layer, mb), rank=kind)

    def start_next(node: int, now: float) -> None:
        if running[node] or not tasks[node]:
            return
        _, (layer, mb) = tasks[node].pop()
        d = duration(node, layer, mb)
        running[node] = True
        busy_time[node] += d
        push(now + d, DONE, node, layer, mb)

    for mb in range(m):
        for a in range(n_a):
            push(0.0, ARRIVE, a, 0, mb)
    while events:
        now, (kind, node, layer, mb) = events.pop()
        if kind == ARRIVE:
            tasks[node].push(now, (layer, mb), rank=layer * m + mb)
            start_next(node, now)
            continue
        running[node] = False
        side = "a" if node < n_a else "e"
        key = (side, layer, mb)
        remaining[key] = remaining.get(key, n_a if side == "a" else n_e) - 1
        last_done[key] = max(last_done.get(key, 0.0), now)
        if remaining[key] == 0:
            t_all = last_done[key]
            if side == "a":  # A2E: dispatch to every expert node
                for e in range(n_e):
                    push(t_all + cjit(tc_fwd), ARRIVE, n_a + e, layer, mb)
            else:  # E2A: results back to every attention node
                arrivals = [t_all + cjit(tc_back) for _ in range(n_a)]
                if layer + 1 < L:
                    for a in range(n_a):
                        push(arrivals[a], ARRIVE, a, layer + 1, mb)
                else:
                    finish[mb] = max(arrivals)
        start_next(node, now)

    total = max(finish)
    tokens = cfg.tokens if cfg.tokens is not None else float(n_a * m)
    return SimResult(
        iteration_time=total,
        throughput=tokens / total if total > 0 else math.inf,
        attention_util=tuple(b / total for b in busy_time[:n_a]),
        expert_util=tuple(b / total for b in busy_time[n_a:]),
        micro_batch_finish=tuple(finish),
        events=events.popped,
    )
