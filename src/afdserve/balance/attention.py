"""Attention balance: requests go to the attention worker whose predicted step time stays lowest.

A decode step of an attention worker costs about the sum over its requests of ``cost(length)``,
each at its current sequence length -- the planner's attention model ``k1(s) = k1_tok + k1_ctx * s``
(``afdserve.planner.attention_request_cost`` reads it from a profile) -- so a worker with a few
long requests can be as loaded as one with many short ones. Request counts would miss that.

With a prefix cache, a worker that holds a request's prompt prefix saves its prefill; ``pick`` sends
the request there unless that worker's predicted step time would exceed the least loaded worker's
by more than ``cache_slack`` (relative), as SGLang's router falls back to the shortest queue when
the load is imbalanced: the saving is paid once, the imbalance on every step of the request's life.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


def unprofiled_request_cost(length: float) -> float:
    """Without a profile: a token of context costs 1/256 of the token's own work."""
    return 1.0 + length / 256


@dataclass
class AttentionBalancer:
    workers: list[str]
    cost: Callable[[float], float] = unprofiled_request_cost  # what a request of that length adds to a step
    lengths: dict[str, dict[str, int]] = field(default_factory=dict)
    cache_slack: float = 0.5  # a cached prefix wins while its worker's predicted step is at most 1.5x the least

    def __post_init__(self) -> None:
        for w in self.workers:
            self.lengths.setdefault(w, {})

    def predicted(self, worker: str, extra_len: int | None = None) -> float:
        lens = list(self.lengths[worker].values()) + ([extra_len] if extra_len is not None else [])
        return sum(self.cost(n) for n in lens)

    def pick(self, prompt_len: int, max_tokens: int, cached: Mapping[str, int] | None = None) -> str:
        """The worker with the lowest predicted step time once it also runs this request (counted
        at its average length over its lifetime) -- or, given ``cached`` (worker -> prompt tokens it
        holds), the one with the longest cached prefix while its load is within ``cache_slack``."""
        expect = prompt_len + max_tokens // 2
        load = {w: self.predicted(w, expect) for w in self.workers}
        best = min(self.workers, key=lambda w: (load[w], len(self.lengths[w])))
        if not cached:
            return best
        hit = max(self.workers, key=lambda w: (cached.get(w, 0), -load[w]))
        if cached.get(hit, 0) > cached.get(best, 0) and load[hit] <= (1 + self.cache_slack) * load[best]:
            return hit
        return best

    def add(self, worker: str, rid: str, length: int) -> None:
        self.lengths[worker][rid] = length

    def update(self, worker: str, rid: str, length: int) -> None:
        if rid in self.lengths[worker]:
            self.lengths[worker][rid] = length

    def remove(self, worker: str, rid: str) -> None:
        self.lengths[worker].pop(rid, None)

    def add_worker(self, worker: str) -> None:
        if worker not in self.workers:
            self.workers.append(worker)
            self.lengths.setdefault(worker, {})

    def remove_worker(self, worker: str) -> None:
        """Stops picking ``worker`` (its requests are moved by the caller)."""
        self.workers.remove(worker)
        self.lengths.pop(worker, None)
