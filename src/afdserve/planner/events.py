"""The discrete-event core of the planner's simulators (:mod:`~afdserve.planner.simulator`,
:mod:`~afdserve.planner.runtime_sim`): a queue of timed events."""

from __future__ import annotations

import heapq
import math
from typing import Generic, TypeVar

__all__ = ["EventQueue"]

T = TypeVar("T")


class EventQueue(Generic[T]):
    """Events in time order; at equal times by ``rank`` (lower first), then in the order pushed."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, T]] = []
        self._pushed = 0
        self.popped = 0  # events taken so far

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, time: float, event: T, rank: int = 0) -> None:
        heapq.heappush(self._heap, (time, rank, self._pushed, event))
        self._pushed += 1

    def pop(self) -> tuple[float, T]:
        """The next event and its time."""
        time, _, _, event = heapq.heappop(self._heap)
        self.popped += 1
        return time, event

    def next_time(self) -> float:
        """When the next event is due (infinity when there is none)."""
        return self._heap[0][0] if self._heap else math.inf
