"""Attention balance: requests go to the attention worker whose predicted step time stays lowest.

A decode step of an attention worker costs about ``sum over its requests of (k1_tok + k1_ctx * len)``
(the planner's attention model, with each request's current sequence length), so a worker with a
few long requests can be as loaded as one with many short ones. Request counts would miss that.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AttentionBalancer:
    workers: list[str]
    k1_tok: float = 1.0  # cost of a token regardless of its context
    k1_ctx: float = 1.0 / 256  # cost per token of context (units of k1_tok without a profile)
    lengths: dict[str, dict[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for w in self.workers:
            self.lengths.setdefault(w, {})

    @classmethod
    def from_profile(cls, workers: list[str], path: str) -> "AttentionBalancer":
        from afdserve.planner.profile import load_profile

        att = load_profile(path).attention
        cost = att[0] if isinstance(att, (list, tuple)) else att
        return cls(workers, cost.k1_tok, cost.k1_ctx)

    def predicted(self, worker: str, extra_len: int | None = None) -> float:
        lens = list(self.lengths[worker].values()) + ([extra_len] if extra_len is not None else [])
        return sum(self.k1_tok + self.k1_ctx * n for n in lens)

    def pick(self, prompt_len: int, max_tokens: int) -> str:
        """The worker with the lowest predicted step time once it also runs this request (counted
        at its average length over its lifetime)."""
        expect = prompt_len + max_tokens // 2
        return min(self.workers, key=lambda w: (self.predicted(w, expect), len(self.lengths[w])))

    def add(self, worker: str, rid: str, length: int) -> None:
        self.lengths[worker][rid] = length

    def update(self, worker: str, rid: str, length: int) -> None:
        if rid in self.lengths[worker]:
            self.lengths[worker][rid] = length

    def remove(self, worker: str, rid: str) -> None:
        self.lengths[worker].pop(rid, None)
