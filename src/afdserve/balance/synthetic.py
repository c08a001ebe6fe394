"""Synthetic routing with skewed popularity and co-activated groups (tests, benchmarks, demos).

Each layer's expert popularity is log-normal (``skew`` is the standard deviation of the
log-popularity). Experts are split into ``groups`` (expert ``e`` in group ``e % groups``) and each
token favours one group, whose experts' log-popularity gets ``+affinity``, so experts of a group
are often chosen together. A token's k experts are drawn without replacement (Gumbel top-k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afdserve.balance.load import LoadSnapshot, LoadTracker


@dataclass(frozen=True)
class SyntheticRouting:
    """A fixed synthetic router: ``popularity`` [L, E] and the group structure."""

    popularity: torch.Tensor  # float32 [L, E], positive
    k: int
    groups: int = 4
    affinity: float = 2.0

    @staticmethod
    def make(
        num_layers: int, num_experts: int, k: int, *, skew: float = 1.0, groups: int = 4, affinity: float = 2.0, seed: int = 0
    ) -> "SyntheticRouting":
        g = torch.Generator().manual_seed(seed)
        pop = torch.exp(skew * torch.randn(num_layers, num_experts, generator=g))
        return SyntheticRouting(pop, k, groups, affinity)

    @property
    def num_layers(self) -> int:
        return int(self.popularity.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.popularity.shape[1])

    def sample(self, layer: int, num_tokens: int, generator: torch.Generator) -> torch.Tensor:
        """int64 [num_tokens, k]: distinct expert ids per token."""
        e = self.num_experts
        logits = self.popularity[layer].log().expand(num_tokens, e).clone()
        if self.groups > 1 and self.affinity:
            group_of = torch.arange(e) % self.groups
            topic = torch.randint(self.groups, (num_tokens,), generator=generator)
            logits += self.affinity * (group_of[None, :] == topic[:, None]).float()
        u = torch.rand(num_tokens, e, generator=generator).clamp_min(1e-20)
        return torch.topk(logits - torch.log(-torch.log(u)), self.k, dim=1).indices

    def snapshot(self, tokens_per_step: int, steps: int, *, seed: int = 0) -> LoadSnapshot:
        """What a :class:`LoadTracker` records over ``steps`` steps of ``tokens_per_step`` tokens."""
        g = torch.Generator().manual_seed(seed)
        tracker = LoadTracker(self.num_layers, self.num_experts, window=steps + 1)  # + the empty step in progress
        for _ in range(steps):
            for layer in range(self.num_layers):
                tracker.record(layer, self.sample(layer, tokens_per_step, g))
            tracker.step()
        return tracker.snapshot()


def synthetic_snapshot(
    num_layers: int,
    num_experts: int,
    k: int,
    *,
    tokens_per_step: int = 64,
    steps: int = 8,
    skew: float = 1.0,
    groups: int = 4,
    affinity: float = 2.0,
    seed: int = 0,
) -> LoadSnapshot:
    """Shorthand: ``SyntheticRouting.make(...).snapshot(tokens_per_step, steps)``."""
    routing = SyntheticRouting.make(num_layers, num_experts, k, skew=skew, groups=groups, affinity=affinity, seed=seed)
    return routing.snapshot(tokens_per_step, steps, seed=seed + 1)
