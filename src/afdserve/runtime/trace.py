"""Spans of work per worker (attention, expert, send, wait, idle), written as Chrome/Perfetto JSON."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator


@dataclass
class Span:
    name: str  # "attention", "expert", "send", "wait", "idle", "step"
    start_us: float
    dur_us: float
    args: dict = field(default_factory=dict)


class Tracer:
    """Records spans when enabled; costs one branch per span when not."""

    def __init__(self, worker: str, enabled: bool = False, limit: int = 2_000_000):
        self.worker, self.enabled, self.limit = worker, enabled, limit
        self.spans: list[Span] = []
        self.pid = os.getpid()

    @contextmanager
    def span(self, name: str, **args: object) -> Iterator[dict]:
        """Records the enclosed block; the yielded dict is the span's args (add to it inside)."""
        if not self.enabled:
            yield args
            return
        t0 = time.time_ns()
        try:
            yield args
        finally:
            self.since(name, t0, **args)

    def since(self, name: str, t0_ns: int, **args: object) -> None:
        """Records a span from ``t0_ns`` (``time.time_ns()``) to now: for a block timed anyway,
        without ``span``'s context manager on the path when tracing is off (check ``enabled``)."""
        if len(self.spans) < self.limit:
            self.spans.append(Span(name, t0_ns / 1e3, time.time_ns() / 1e3 - t0_ns / 1e3, args))

    def events(self, tid: int) -> list[dict]:
        meta = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": self.worker}},
                {"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": tid, "args": {"sort_index": tid}}]
        return meta + [{"name": s.name, "cat": s.name, "ph": "X", "ts": s.start_us, "dur": s.dur_us, "pid": 0,
                        "tid": tid, "args": s.args} for s in self.spans]


def idle_span(t0_ns: int) -> Span:
    """The span from ``t0_ns`` (``time.time_ns()``) to now, named idle."""
    return Span("idle", t0_ns / 1e3, (time.time_ns() - t0_ns) / 1e3)


def write_chrome_trace(path: str, per_worker: dict[str, list[dict]]) -> None:
    """``per_worker``: worker name -> its ``Tracer.events`` (already numbered)."""
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "afdserve"}}]
    for evs in per_worker.values():
        events.extend(evs)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
