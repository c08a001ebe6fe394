"""What a deployment reports while serving, read the same way from the colocated ``Engine`` and the
disaggregated ``LocalCluster``: requests running and waiting, KV-cache usage per attention worker,
tokens per expert and per expert worker, micro-batch sizes, and each worker's busy time.

Everything here runs in the engine thread (the engine is not thread-safe); the server reads the
immutable ``EngineStats`` snapshots it produces.

Busy time: the colocated engine's step seconds; for the worker processes of a cluster, the CPU
seconds the kernel accounted to them (``/proc/<pid>/stat``), divided by their torch threads. Waits
for peers block (after a 50 us spin), so CPU time is compute time.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from afdserve.balance.load import LoadSnapshot, LoadTracker
from afdserve.engine.engine import Engine

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class EngineStats:
    running: int = 0
    waiting: int = 0  # in the engine's queues, plus accepted requests not yet handed to it
    kv_usage: dict[str, float] = field(default_factory=dict)  # attention worker -> used fraction of its blocks
    expert_tokens: list[list[int]] = field(default_factory=list)  # [layer][expert] tokens routed so far
    expert_worker_tokens: dict[str, int] = field(default_factory=dict)  # expert worker -> tokens sent to it so far
    busy_seconds: dict[str, float] = field(default_factory=dict)  # worker -> busy seconds so far
    busy_fraction: dict[str, float] = field(default_factory=dict)  # worker -> busy share of the last interval
    expert_load: LoadSnapshot | None = None  # the recent window (afdserve.balance), refreshed every interval


def micro_batch_sizes(tokens: int, micro_batches: int) -> list[int]:
    """Token counts of the micro-batches of a step of ``tokens`` tokens (as
    ``afdserve.runtime.microbatch.split`` cuts it)."""
    if tokens <= 0:
        return []
    m = max(1, min(micro_batches, tokens))
    bounds = [round(tokens * i / m) for i in range(m + 1)]
    return [bounds[i + 1] - bounds[i] for i in range(m)]


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14 and 15 of stat)


class ExpertTokenCounter:
    """Wraps the colocated runner's MoE function: counts the tokens routed to each expert, and
    records the routing in a ``LoadTracker`` (the recent window, as the workers of a cluster do)."""

    def __init__(self, moe: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                 num_layers: int, num_experts: int, load_window: int):
        self.moe = moe
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        self.tracker = LoadTracker(num_layers, num_experts, load_window)

    def __call__(self, layer: int, y: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        self.counts[layer] += torch.bincount(ids.reshape(-1), minlength=self.counts.shape[1])[: self.counts.shape[1]]
        self.tracker.record(layer, ids)
        return self.moe(layer, y, ids, w)


class _BusyMeter:
    """Turns cumulative busy seconds into the busy fraction of each interval between refreshes."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[float, float]] = {}
        self.fraction: dict[str, float] = {}

    def update(self, busy: dict[str, float], now: float) -> None:
        for name, b in busy.items():
            prev = self.last.get(name)
            if prev is not None and now > prev[0]:
                self.fraction[name] = min(1.0, max(0.0, (b - prev[1]) / (now - prev[0])))
            self.last[name] = (now, b)


class StatsSource:
    """Reads a deployment's state in the engine thread. ``after_step`` (after each step; a
    cluster's: after each poll) returns the micro-batch sizes of the steps it saw; ``refresh``
    (every stats interval) updates busy fractions and the expert load window."""

    def after_step(self, step_seconds: float) -> list[int]:
        raise NotImplementedError

    def refresh(self) -> None:
        raise NotImplementedError

    def snapshot(self, pending: int) -> EngineStats:
        raise NotImplementedError


class ColocatedStats(StatsSource):
    def __init__(self, engine: Engine, load_window: int):
        self.engine = engine
        runner: Any = engine.runner
        self.counter: ExpertTokenCounter | None = None
        if hasattr(runner, "moe") and hasattr(runner, "model"):
            cfg = runner.model.cfg
            self.counter = ExpertTokenCounter(runner.moe, cfg.num_layers, cfg.num_experts, load_window)
            runner.moe = self.counter
        self.busy = 0.0
        self.meter = _BusyMeter()
        self.load: LoadSnapshot | None = None
        self.expert_tokens: list[list[int]] = []  # per-expert figures: read at each refresh

    def after_step(self, step_seconds: float) -> list[int]:
        tokens = self.engine.last_step.num_tokens
        if tokens:
            self.busy += step_seconds
            if self.counter is not None:
                self.counter.tracker.step()
        return micro_batch_sizes(tokens, 1)

    def refresh(self) -> None:
        self.meter.update({"engine": self.busy}, time.monotonic())
        if self.counter is not None:
            self.load = self.counter.tracker.snapshot()
            self.expert_tokens = self.counter.counts.tolist()

    def snapshot(self, pending: int) -> EngineStats:
        sched = self.engine.scheduler
        return EngineStats(
            running=len(sched.running), waiting=len(sched.waiting) + pending,
            kv_usage={"engine": self.engine.blocks.usage}, expert_tokens=self.expert_tokens,
            busy_seconds={"engine": self.busy}, busy_fraction=dict(self.meter.fraction), expert_load=self.load)


class ClusterStats(StatsSource):
    """Attention workers report running/waiting/KV usage/step size with every output message and
    on request; expert workers report tokens per expert on request (``LocalCluster.request_stats``)."""

    def __init__(self, cluster: Any):
        from afdserve.runtime.workers import expert_name

        self.cluster = cluster
        self.micro_batches = cluster.cfg.micro_batches
        self.threads = cluster.cfg.num_threads or 1
        self.expert_names = [expert_name(j) for j in range(cluster.cfg.expert_workers)]
        self.last_step_s: dict[str, float] = {}
        self.busy: dict[str, float] = {}
        self.meter = _BusyMeter()
        self.load: LoadSnapshot | None = None
        self.expert_tokens: list[list[int]] = []  # per-expert figures: read at each refresh

    def after_step(self, step_seconds: float) -> list[int]:
        sizes: list[int] = []
        for name in self.cluster.attention:
            s = self.cluster.stats.get(name)
            if not s or s.get("step_s") == self.last_step_s.get(name):
                continue  # nothing new from this worker (a stats reply repeats the last step)
            self.last_step_s[name] = s["step_s"]
            sizes += micro_batch_sizes(int(s.get("step_tokens", 0)), self.micro_batches)
        return sizes

    def refresh(self) -> None:
        loads = [LoadSnapshot.from_json(st["load"]) for st in self.cluster.stats.values() if "load" in st]
        self.load = LoadSnapshot.merge(loads) if loads else None  # the replies to the last request
        self.expert_tokens = self._expert_tokens()
        self.cluster.request_stats()
        for name, w in self.cluster.workers.items():
            cpu = None if w.dead or w.pid is None else cpu_seconds(w.pid)
            if cpu is not None:
                self.busy[name] = cpu / self.threads
        self.meter.update(self.busy, time.monotonic())

    def snapshot(self, pending: int) -> EngineStats:
        st = self.cluster.stats
        att = [st[a] for a in self.cluster.attention if a in st]
        per_worker: dict[str, int] = {n: 0 for n in self.expert_names}
        for s in att:
            for j, n in enumerate(s.get("tokens_per_expert_worker", ())):
                per_worker[self.expert_names[j]] += int(n)
        return EngineStats(
            running=sum(int(s.get("running", 0)) for s in att),
            waiting=sum(int(s.get("waiting", 0)) for s in att) + pending,
            kv_usage={a: float(st[a].get("kv_usage", 0.0)) for a in self.cluster.attention if a in st},
            expert_tokens=self.expert_tokens, expert_worker_tokens=per_worker,
            busy_seconds=dict(self.busy), busy_fraction=dict(self.meter.fraction), expert_load=self.load)

    def _expert_tokens(self) -> list[list[int]]:
        """Per layer and expert, the tokens the expert workers computed (each worker counts the
        (token, k) pairs it computed; the last column counts pairs that were not its own)."""
        counts = [self.cluster.stats.get(n, {}).get("tokens_per_expert") for n in self.expert_names]
        if not counts or any(c is None for c in counts):
            return []
        layers, experts = len(counts[0]), len(counts[0][0]) - 1
        return [[sum(int(c[layer][e]) for c in counts) for e in range(experts)] for layer in range(layers)]


def stats_source(engine: Any, load_window: int = 64) -> StatsSource:
    """The colocated engine's (expert load over ``load_window`` steps) or a cluster's (its workers
    keep the window, ``EngineConfig.load_window``)."""
    return ColocatedStats(engine, load_window) if isinstance(engine, Engine) else ClusterStats(engine)
