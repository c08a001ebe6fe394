"""A linear layer whose weight is packed once for the linear backend (``prepare``)."""

from __future__ import annotations

import torch
from torch import nn

from afdserve.backends import Backends
from afdserve.backends.base import LinearOp


class Linear(nn.Module):
    """``y = x W^T + b`` over ``op``, the weight packed for the chosen backend by ``prepare`` (after
    the weights are loaded and moved to their device)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.op: LinearOp | None = None

    def prepare(self, backends: Backends) -> None:
        self.op = backends.linear.pack(self.weight, self.bias)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.op(x, out_dtype)
