"""Small building blocks shared by the attention and expert parts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afdserve.backends import Backends
from afdserve.backends.base import LinearOp, NormBackend


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.ops: NormBackend | None = None

    def prepare(self, backends: Backends) -> None:
        self.ops = backends.norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) with h = x + residual, one pass where the backend fuses them."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class GatedMLP(nn.Module):
    """``down(silu(gate(y)) * up(y))`` with gate and up stacked in one [2I, H] matrix."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(2 * intermediate, hidden, dtype=dtype), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(hidden, intermediate, dtype=dtype), requires_grad=False)
        self.gate_up: LinearOp | None = None
        self.down: LinearOp | None = None

    def prepare(self, backends: Backends) -> None:
        self.gate_up, self.down = backends.linear.pack(self.w_gate_up), backends.linear.pack(self.w_down)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(y).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def prepare_all(module: nn.Module, backends: Backends) -> None:
    """Packs the weights of ``module`` and its submodules for ``backends``: every module with a
    ``prepare(backends)`` method, children before parents."""
    for child in module.children():
        prepare_all(child, backends)
    if callable(getattr(module, "prepare", None)):
        module.prepare(backends)
