"""What an expert worker does with the tokens it received for one layer."""

from __future__ import annotations

import torch

from afdserve.model.model import ExpertModel
from afdserve.model.router import Router


class ExpertCompute:
    """Runs this worker's experts of a layer once over the tokens gathered from all attention
    workers. With the expert-side gate, the router runs here on the full activations."""

    def __init__(self, experts: ExpertModel, routers: list[Router] | None):
        self.experts, self.routers = experts, routers
        self.tokens_per_expert = torch.zeros(experts.cfg.num_layers, experts.cfg.num_experts + 1, dtype=torch.int64)

    @torch.inference_mode()
    def run(self, layer: int, parts: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """``parts``: per sender, [y] (expert gate) or [y, ids, weights] (attention gate).
        Returns per sender the partial sums [n_i, H]."""
        sizes = [p[0].shape[0] for p in parts]
        y = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        if len(parts[0]) == 1:
            if self.routers is None:
                raise RuntimeError("expert-side gate requested but this worker has no router weights")
            ids, w = self.routers[layer](y)
        else:
            ids = torch.cat([p[1] for p in parts]).to(torch.int64) if len(parts) > 1 else parts[0][1].to(torch.int64)
            w = torch.cat([p[2] for p in parts]) if len(parts) > 1 else parts[0][2]
        self.tokens_per_expert[layer] += torch.bincount(ids.reshape(-1), minlength=self.tokens_per_expert.shape[1])
        out = self.experts.layers[layer](y, ids, w)
        return list(out.split(sizes))
