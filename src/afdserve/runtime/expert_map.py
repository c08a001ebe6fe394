"""Logical -> physical expert map: which expert workers hold a replica of each expert, per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afdserve.errors import ConfigError


@dataclass
class ExpertMap:
    num_workers: int
    # holders[layer][expert] = expert workers holding a replica of that expert (ordered)
    holders: list[list[list[int]]]

    @property
    def num_layers(self) -> int:
        return len(self.holders)

    @property
    def num_experts(self) -> int:
        return len(self.holders[0])

    @staticmethod
    def contiguous(num_layers: int, num_experts: int, num_workers: int,
                   sizes: list[int] | None = None) -> "ExpertMap":
        """Experts split into contiguous ranges (``sizes[w]`` experts on worker w; default as even
        as possible, the first workers taking one more)."""
        if num_workers < 1:
            raise ConfigError("expert_workers must be >= 1 for an expert map")
        if num_workers > num_experts:
            raise ConfigError(f"invalid expert_workers={num_workers}: the model has only {num_experts} experts")
        if sizes is None:
            base, extra = divmod(num_experts, num_workers)
            sizes = [base + (w < extra) for w in range(num_workers)]
        if len(sizes) != num_workers or sum(sizes) != num_experts or min(sizes) < 1:
            raise ConfigError(f"invalid expert split {sizes} for {num_experts} experts on {num_workers} workers")
        owner = [w for w, n in enumerate(sizes) for _ in range(n)]
        return ExpertMap(num_workers, [[[owner[e]] for e in range(num_experts)] for _ in range(num_layers)])

    def experts_of(self, worker: int) -> list[list[int]]:
        """Per layer, the logical experts that ``worker`` holds."""
        return [[e for e, ws in enumerate(layer) if worker in ws] for layer in self.holders]

    def route(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """The worker that computes each (token, k) pair. A replicated expert's tokens are spread
        over its replicas by token index (deterministic)."""
        tab = self._tables(layer)
        owner, n_rep = tab
        first = owner[topk_ids, 0]
        if int(n_rep.max()) == 1:
            return first
        tok = torch.arange(topk_ids.shape[0])[:, None].expand_as(topk_ids)
        choice = tok % n_rep[topk_ids]
        return owner[topk_ids, choice]

    def _tables(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.__dict__.setdefault("_cache", {})
        if layer not in cache:
            layer_h = self.holders[layer]
            width = max(len(ws) for ws in layer_h)
            owner = torch.zeros(len(layer_h), width, dtype=torch.int64)
            for e, ws in enumerate(layer_h):
                owner[e, : len(ws)] = torch.tensor(ws)
            cache[layer] = (owner, torch.tensor([len(ws) for ws in layer_h]))
        return cache[layer]
