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


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """``F.scaled_dot_product_attention``; on CUDA, inputs whose rows do not start on 16-byte
    boundaries (a slice of wider rows, an odd head dimension) go through the math backend: the
    fused kernels load them 16 bytes at a time. Seen on an H200 with the tiny DeepSeek-V3 test
    shapes (values sliced at an offset of 10 float32 columns): "misaligned address"."""
    if q.is_cuda and not torch.compiler.is_compiling() and not all(_rows_aligned(t) for t in (q, k, v)):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, **kw)
    return F.scaled_dot_product_attention(q, k, v, **kw)


def _rows_aligned(t: torch.Tensor) -> bool:
    n = t.element_size()
    return t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and t.shape[-1] * n % 16 == 0 and all(
        s * n % 16 == 0 for s, d in zip(t.stride()[:-1], t.shape[:-1]) if d > 1)
