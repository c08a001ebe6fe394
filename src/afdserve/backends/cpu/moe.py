"""The fused MoE kernel: every routed (token, expert) pair of a layer in one call over the held
experts' weights packed once, no loop over experts, no gathered token copies; it counts the routed
ids as it sorts the pairs."""

from __future__ import annotations

import torch

from afdserve.backends.base import Activation
from afdserve.backends.cpu import ops, supports
from afdserve.backends.pytorch.moe import GroupedExperts


class FusedExperts:
    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, b_gate_up: torch.Tensor | None,
                 b_down: torch.Tensor | None, act: Activation):
        self.w13, self.w2 = ops.pack_gate_up(w_gate_up), ops.pack_down(w_down)
        self.b13 = None if b_gate_up is None else b_gate_up.float().contiguous()
        self.b2 = None if b_down is None else b_down.float().contiguous()
        self.inter, self.act = int(w_down.shape[2]), act
        self._moe = ops.ops().fused_moe

    def __call__(self, y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, local: torch.Tensor,
                 counts: torch.Tensor | None = None) -> torch.Tensor:
        a = self.act
        return self._moe(y.contiguous(), self.w13, self.w2, self.b13, self.b2, ids.contiguous(),
                         weights.float().contiguous(), local, self.inter, ops.ACTIVATIONS[a.kind], a.alpha, a.limit,
                         counts)


class CpuMoE:
    name = "cpu"

    def pack(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, b_gate_up: torch.Tensor | None,
             b_down: torch.Tensor | None, act: Activation) -> FusedExperts | GroupedExperts:
        """The kernel's experts where it runs them (held experts, an even hidden size, a dtype it
        has here), else PyTorch's (a part holding none: zeros and the counts)."""
        fits = w_gate_up.shape[0] > 0 and w_gate_up.shape[2] % 2 == 0 and supports("fused_moe", w_gate_up.dtype)
        return (FusedExperts if fits else GroupedExperts)(w_gate_up, w_down, b_gate_up, b_down, act)
