"""Logical -> physical expert map: which expert workers hold a replica of each expert, per layer.

A thin runtime view of ``afdserve.balance.Placement``: the attention side asks which worker
computes each (token, k) pair; a replicated expert's tokens go to one of its replicas chosen by
the deterministic JANUS routing, so every process computes the same assignment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from afdserve.balance.placement import EMPTY, LayerPlacement, Placement
from afdserve.balance.routing import route_replicas_device
from afdserve.errors import ConfigError


@dataclass
class ExpertMap:
    placement: Placement
    _owner: dict[tuple[int, torch.device], torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_workers(self) -> int:
        return self.placement.layers[0].num_workers

    @property
    def num_layers(self) -> int:
        return len(self.placement.layers)

    @property
    def num_experts(self) -> int:
        return self.placement.layers[0].num_experts

    @staticmethod
    def contiguous(num_layers: int, num_experts: int, num_workers: int,
                   sizes: list[int] | None = None) -> "ExpertMap":
        """Experts split into contiguous ranges (``sizes[w]`` experts on worker w; default as even
        as possible, the first workers taking one more); no replicas."""
        if num_workers < 1:
            raise ConfigError("expert_workers must be >= 1 for an expert map")
        if num_workers > num_experts:
            raise ConfigError(f"invalid expert_workers={num_workers}: the model has only {num_experts} experts")
        if sizes is None:
            base, extra = divmod(num_experts, num_workers)
            sizes = [base + (w < extra) for w in range(num_workers)]
        if len(sizes) != num_workers or sum(sizes) != num_experts or min(sizes) < 1:
            raise ConfigError(f"invalid expert_split={sizes}: need {num_workers} counts >= 1 summing to {num_experts}")
        starts = [sum(sizes[:w]) for w in range(num_workers)]
        layer = LayerPlacement(num_experts, tuple(tuple(range(s, s + n)) for s, n in zip(starts, sizes)))
        return ExpertMap(Placement(tuple(layer for _ in range(num_layers))))

    def experts_of(self, worker: int) -> list[list[int]]:
        """Per layer, the logical experts that ``worker`` holds."""
        return [list(layer.experts_on(worker)) for layer in self.placement.layers]

    def route(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """int64 [T, k] on the ids' device: the expert worker that computes each (token, k) pair
        (-1: an expert no worker holds). Tensor ops only: nothing is read back to the host."""
        lp = self.placement.layers[layer]
        if lp._cache.get("replicated", None) is None:
            lp._cache["replicated"] = int(lp.replica_counts().max()) > 1
        if lp._cache["replicated"]:
            return route_replicas_device(topk_ids, lp)
        key = (layer, topk_ids.device)
        if key not in self._owner:
            self._owner[key] = torch.tensor([(lp.replicas_of(e) or (-1,))[0] for e in range(lp.num_experts)],
                                            device=topk_ids.device)
        return self._owner[key][topk_ids.long()]

    def held_counts(self, layer: int) -> list[int]:
        """Per worker, the distinct logical experts it holds in ``layer``."""
        lp = self.placement.layers[layer]
        return [len(lp.experts_on(w)) for w in range(lp.num_workers)]

    def without(self, workers: set[int]) -> "ExpertMap":
        """This map while ``workers`` are missing: they hold nothing (their slots empty), so a
        replicated expert's tokens go to its replicas on the others."""
        return ExpertMap(Placement(tuple(
            LayerPlacement(lp.num_experts, tuple((EMPTY,) * len(s) if w in workers else s
                                                 for w, s in enumerate(lp.slots)))
            for lp in self.placement.layers)))

    def lost_experts(self) -> torch.Tensor:
        """bool [L, E]: the experts no worker holds (a missing worker's unreplicated experts)."""
        return torch.tensor([[len(lp.replicas_of(e)) == 0 for e in range(lp.num_experts)]
                             for lp in self.placement.layers])
