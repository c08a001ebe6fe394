"""The expert part of a MoE layer: routed SwiGLU experts (grouped) and the shared expert."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from afdserve.model.config import ModelConfig
from afdserve.model.layers import swiglu


class ExpertPart(nn.Module):
    """Holds the routed experts ``expert_ids`` (logical ids) of one layer.

    ``forward`` runs each held expert once over all the tokens routed to it and returns the
    router-weighted sum of their outputs; tokens routed to experts held elsewhere get zero.
    """

    def __init__(self, cfg: ModelConfig, expert_ids: Sequence[int], dtype: torch.dtype):
        super().__init__()
        self.expert_ids = list(expert_ids)
        n, h, i = len(self.expert_ids), cfg.hidden_size, cfg.moe_intermediate_size
        self.w_gate_up = nn.Parameter(torch.empty(n, 2 * i, h, dtype=dtype), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(n, h, i, dtype=dtype), requires_grad=False)
        # logical id -> index in this part; id num_experts marks "routed to another worker"
        local = torch.full((cfg.num_experts + 1,), -1, dtype=torch.int64)
        for j, e in enumerate(self.expert_ids):
            local[e] = j
        self.register_buffer("local_index", local, persistent=False)

    def forward(self, y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(y)
        k = topk_ids.shape[1]
        local = self.local_index[topk_ids.reshape(-1)]
        hit = (local >= 0).nonzero().squeeze(1)
        if hit.numel() == 0:
            return out
        order = torch.argsort(local[hit], stable=True)
        pairs = hit[order]  # flat (token, slot) pairs grouped by expert, experts in held order
        counts = torch.bincount(local[pairs], minlength=len(self.expert_ids)).tolist()
        tokens = pairs // k
        x = y[tokens]
        parts = []
        start = 0
        for j, c in enumerate(counts):
            if c:
                parts.append(swiglu(x[start : start + c], self.w_gate_up[j], self.w_down[j]))
            start += c
        res = torch.cat(parts) * topk_weights.reshape(-1)[pairs, None]
        out.index_add_(0, tokens, res.to(y.dtype))
        return out


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: ``sigmoid(gate(y)) * mlp(y)``."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        h, i = cfg.hidden_size, cfg.shared_expert_intermediate_size
        self.w_gate_up = nn.Parameter(torch.empty(2 * i, h, dtype=dtype), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(h, i, dtype=dtype), requires_grad=False)
        self.gate = nn.Parameter(torch.empty(1, h, dtype=dtype), requires_grad=False)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(y, self.gate)) * swiglu(y, self.w_gate_up, self.w_down)
