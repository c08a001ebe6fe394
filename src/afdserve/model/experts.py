"""The expert part of a MoE layer: routed SwiGLU experts (grouped) and the shared expert."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from afdserve.model.config import ModelConfig
from afdserve.model.layers import swiglu


def grouped_swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   counts: torch.Tensor) -> torch.Tensor:
    """SwiGLU of rows grouped by expert: rows ``[sum(counts[:j]), sum(counts[:j+1]))`` of ``x`` go
    through expert j (``w_gate_up[j]`` [2I, H], ``w_down[j]`` [H, I]). One grouped GEMM per
    projection for all experts (``torch._grouped_mm``), no Python loop over experts."""
    if any(d * x.element_size() % 16 for d in (x.shape[1], w_down.shape[2], w_gate_up.shape[1])):
        # the grouped GEMM needs 16-byte aligned rows: a loop for such (tiny) shapes
        parts = [swiglu(rows, w_gate_up[j], w_down[j]) for j, rows in enumerate(x.split(counts.tolist()))]
        return torch.cat(parts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    gate, up = torch._grouped_mm(x, w_gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm((F.silu(gate) * up).contiguous(), w_down.transpose(1, 2), offs=offs)


class ExpertPart(nn.Module):
    """Holds the routed experts ``expert_ids`` (logical ids) of one layer.

    ``forward`` runs each held expert once over all the tokens routed to it (one grouped GEMM per
    projection) and returns the router-weighted sum of their outputs; tokens routed to experts held
    elsewhere get zero.
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
        counts = torch.bincount(local[pairs], minlength=len(self.expert_ids))
        tokens = pairs // k
        res = grouped_swiglu(y[tokens], self.w_gate_up, self.w_down, counts)
        res = res * topk_weights.reshape(-1)[pairs, None]
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
