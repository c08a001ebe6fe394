"""What a cluster reports, gathered in the front end from its workers' messages: attention workers
send their running/waiting/KV usage/step size with every ``StepOutputs`` and on ``GetStats``; expert
workers send tokens per expert on ``GetStats``. Busy time is the CPU seconds the kernel accounted to
each worker process, divided by its torch threads (waits for peers block after a short spin, so
CPU time is compute time)."""

from __future__ import annotations

import time

from afdserve.balance.load import LoadSnapshot
from afdserve.engine.stats import BusyMeter, EngineStats, cpu_seconds
from afdserve.kvcache.prefix import PrefixCacheStats
from afdserve.runtime.messages import AttentionStats, ExpertStats


class ClusterStats:
    def __init__(self, attention: list[str], experts: list[str], threads: int):
        self.attention, self.experts, self.threads = attention, experts, threads
        self.latest: dict[str, AttentionStats | ExpertStats] = {}
        self.loads: dict[str, str] = {}  # worker -> its last reported load window (JSON)
        self.prefix: dict[str, PrefixCacheStats] = {}  # attention worker -> its last reported prefix cache
        self.busy: dict[str, float] = {}
        self.meter = BusyMeter()
        self.load: LoadSnapshot | None = None
        self.expert_tokens: list[list[int]] = []  # per-expert figures: read at each refresh
        self.sizes: list[int] = []  # micro-batches run since the last snapshot
        self.dropped = 0  # expert assignments the attention workers dropped (a missing expert worker)
        self.capacity_dropped = 0  # ... over an expert worker's capacity
        self.second_pass_rows = 0  # token rows sent in second passes

    def on_step(self, worker: str, stats: AttentionStats) -> None:
        """An attention worker's step (one lane of its pipeline: a micro-batch) was done."""
        self.latest[worker] = stats
        self._count(stats)
        if stats.step_tokens:
            self.sizes.append(stats.step_tokens)

    def on_stats(self, worker: str, stats: AttentionStats | ExpertStats) -> None:
        self.latest[worker] = stats
        if isinstance(stats, AttentionStats):
            self._count(stats)
        if stats.load is not None:
            self.loads[worker] = stats.load
        if isinstance(stats, AttentionStats) and stats.prefix is not None:
            self.prefix[worker] = stats.prefix

    def _count(self, stats: AttentionStats) -> None:
        self.dropped += stats.dropped
        self.capacity_dropped += stats.capacity_dropped
        self.second_pass_rows += stats.second_pass_rows

    def refresh(self, pids: dict[str, int | None]) -> None:
        loads = [LoadSnapshot.from_json(js) for js in self.loads.values()]
        self.load = LoadSnapshot.merge(loads) if loads else None  # the replies to the last request
        self.expert_tokens = self._expert_tokens()
        for name, pid in pids.items():
            cpu = None if pid is None else cpu_seconds(pid)
            if cpu is not None:
                self.busy[name] = cpu / self.threads
        self.meter.update(self.busy, time.monotonic())

    def snapshot(self) -> EngineStats:
        att = [st for a in self.attention if isinstance(st := self.latest.get(a), AttentionStats)]
        per_worker = {n: 0 for n in self.experts}
        for s in att:
            for name, n in zip(self.experts, s.tokens_per_expert_worker):
                per_worker[name] += int(n)
        sizes, self.sizes = self.sizes, []
        return EngineStats(
            running=sum(s.running for s in att), waiting=sum(s.waiting for s in att),
            kv_usage={a: st.kv_usage for a in self.attention if isinstance(st := self.latest.get(a), AttentionStats)},
            expert_tokens=self.expert_tokens, expert_worker_tokens=per_worker, busy_seconds=dict(self.busy),
            busy_fraction=dict(self.meter.fraction), expert_load=self.load, micro_batch_sizes=sizes,
            prefix_cache=dict(self.prefix), dropped_expert_assignments=self.dropped,
            capacity_dropped_assignments=self.capacity_dropped, second_pass_rows=self.second_pass_rows)

    def _expert_tokens(self) -> list[list[int]]:
        """Per layer and expert, the tokens the expert workers computed (each worker counts the
        (token, k) pairs it computed; the last column counts pairs that were not its own)."""
        counts = [st.tokens_per_expert if isinstance(st := self.latest.get(n), ExpertStats) else None
                  for n in self.experts]
        if not counts or any(c is None for c in counts):
            return []
        layers, experts = len(counts[0]), len(counts[0][0]) - 1
        return [[sum(int(c[layer][e]) for c in counts) for e in range(experts)] for layer in range(layers)]
