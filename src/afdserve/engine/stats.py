"""What a deployment reports while serving: ``EngineStats`` snapshots (immutable; the server reads
them from any thread), and the helpers the clients use to compute busy time."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from afdserve.balance.load import LoadSnapshot
from afdserve.kvcache.prefix import PrefixCacheStats

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
    micro_batch_sizes: list[int] = field(default_factory=list)  # tokens of each micro-batch run since the last snapshot
    workers: dict[str, str] = field(default_factory=dict)  # worker -> "up" | "down" | "restarting" (colocated: none)
    restarts: dict[str, int] = field(default_factory=dict)  # worker -> restarts so far
    last_failure: dict[str, str] = field(default_factory=dict)  # worker -> why it last failed
    prefix_cache: dict[str, PrefixCacheStats] = field(default_factory=dict)  # worker -> its prefix cache (refreshed)
    dropped_expert_assignments: int = 0  # (token, k) pairs dropped while an expert worker was missing (so far)
    capacity_dropped_assignments: int = 0  # (token, k) pairs dropped over an expert worker's capacity (so far)
    second_pass_rows: int = 0  # token rows sent to expert workers in a second pass, over capacity (so far)


def process_tree(root: int) -> list[int]:
    """``root`` and every process under it, ``root`` first (only ``root`` where there is no /proc)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return [root]
    for d in entries:
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
            except (OSError, IndexError):
                pass
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14 and 15 of stat)


class BusyMeter:
    """Turns cumulative busy seconds into the busy fraction of each interval between updates."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[float, float]] = {}
        self.fraction: dict[str, float] = {}

    def update(self, busy: dict[str, float], now: float) -> None:
        for name, b in busy.items():
            prev = self.last.get(name)
            if prev is not None and now > prev[0]:
                self.fraction[name] = min(1.0, max(0.0, (b - prev[1]) / (now - prev[0])))
            self.last[name] = (now, b)
