"""The expert part of a MoE layer (routed experts, packed once for the MoE backend) and Qwen2-MoE's
gated shared expert.

An expert is ``down(act(gate_up(y)))`` with gate and up stacked in one [2I, H] matrix; gpt-oss's
experts add biases to both projections and use its clamped SwiGLU (``backends.base.Activation``)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from afdserve.backends import Backends
from afdserve.backends.base import Activation, Experts
from afdserve.model.config import ModelConfig
from afdserve.model.layers import GatedMLP


def activation_of(cfg: ModelConfig) -> Activation:
    return Activation(cfg.expert_activation, cfg.swiglu_alpha, cfg.swiglu_limit)


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
        self.b_gate_up = nn.Parameter(torch.empty(n, 2 * i, dtype=dtype), requires_grad=False) \
            if cfg.expert_bias else None
        self.b_down = nn.Parameter(torch.empty(n, h, dtype=dtype), requires_grad=False) if cfg.expert_bias else None
        self.act = activation_of(cfg)
        # logical id -> index in this part; id num_experts marks "routed to another worker"
        local = torch.full((cfg.num_experts + 1,), -1, dtype=torch.int64)
        for j, e in enumerate(self.expert_ids):
            local[e] = j
        self.register_buffer("local_index", local, persistent=False)
        self.experts: Experts | None = None

    def prepare(self, backends: Backends) -> None:
        """Packs the held experts for ``backends`` (again after ``set_weights``)."""
        self.experts = backends.moe.pack(self.w_gate_up, self.w_down, self.b_gate_up, self.b_down, self.act)

    def forward(self, y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                counts: torch.Tensor | None = None) -> torch.Tensor:
        """``counts`` (int64 [num_experts + 1], on y's device): each (token, slot) pair's id is counted
        into it (an expert worker's load statistics)."""
        return self.experts(y, topk_ids, topk_weights, self.local_index, counts)

    def weights(self, j: int) -> tuple[torch.Tensor, ...]:
        """Held expert j's tensors: (gate_up [2I, H], down [H, I]) and, with biases, (b_gate_up, b_down)."""
        if self.b_gate_up is None:
            return self.w_gate_up[j], self.w_down[j]
        return self.w_gate_up[j], self.w_down[j], self.b_gate_up[j], self.b_down[j]

    def set_weights(self, j: int, tensors: Sequence[torch.Tensor]) -> None:
        """Copies one expert's tensors (as ``weights`` returns them) into held slot j; the part is
        packed (``prepare``) once all its experts are set."""
        mine = self.weights(j)
        if len(tensors) != len(mine):
            raise ValueError(f"expert weights: {len(tensors)} tensors given, {len(mine)} held")
        for dst, src in zip(mine, tensors):
            dst.copy_(src)
        self.experts = None


class SharedExpert(GatedMLP):
    """Qwen2-MoE's shared expert: ``sigmoid(gate(y)) * mlp(y)``."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__(cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype)
        self.gate = nn.Parameter(torch.empty(1, cfg.hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(y, self.gate)) * super().forward(y)
