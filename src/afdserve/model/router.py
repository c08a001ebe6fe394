"""The router (gate) of a MoE layer: softmax over experts, then top-k."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afdserve.model.config import ModelConfig


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.top_k = cfg.top_k
        self.normalize = cfg.norm_topk_prob

    def forward(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (topk_ids [T, k] int64, topk_weights [T, k] float32)."""
        probs = F.softmax(F.linear(y, self.weight).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights
