"""Timing the runtime's code in the measuring thread's CPU time: what a call costs even when other
processes take turns on its core (equal to wall time on an idle core)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["cpu_time", "median_time", "CpuTracer"]

cpu_time = time.thread_time  # CPU time of this thread


def median_time(fn: Callable[[], object], repeats: int, before: Callable[[], None] | None = None) -> float:
    """Median CPU time of ``fn`` over ``repeats`` calls, ``before`` running untimed before each."""
    ts = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = cpu_time()
        fn()
        ts.append(cpu_time() - t0)
    return float(statistics.median(ts))


class CpuTracer:
    """Stands in for the runtime's ``Tracer``: records ``(name, phase, start, end)`` spans in this
    thread's CPU time."""

    enabled = True

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, float, float]] = []

    @contextmanager
    def span(self, name: str, **args: object) -> Iterator[dict[str, object]]:
        t0 = cpu_time()
        try:
            yield args
        finally:
            self.spans.append((name, str(args.get("phase", "")), t0, cpu_time()))
