"""Small building blocks shared by the attention and expert parts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afdserve import kernels
from afdserve.kernels.layers import add_rms_norm, rms_norm
from afdserve.model.linear import linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_contiguous() and kernels.supports("rms_norm", x):
            return rms_norm(x.view(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) with h = x + residual, one pass when the kernel runs."""
        if x.is_contiguous() and residual.is_contiguous() and x.dim() == 2 and kernels.supports("rms_norm", x):
            return add_rms_norm(x, residual, self.weight, self.eps)
        h = x + residual
        return h, self(h)


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with gate and up stacked in one [2I, H] matrix."""
    gate, up = linear(x, w_gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, w_down)
