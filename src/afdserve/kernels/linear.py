"""The linear kernel (``csrc/linear.cpp``): y = x W^T + bias over a weight packed once."""

from __future__ import annotations

import torch

from afdserve.kernels import ops
from afdserve.kernels.packing import BLOCK, blocks


def pack(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the kernel's column blocks (N padded with zero rows to a multiple of 32)."""
    n, k = w.shape
    npad = -(-n // BLOCK) * BLOCK
    if npad != n:
        w = torch.cat([w, w.new_zeros(npad - n, k)])
    return blocks(w.contiguous()[None])[0]


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] (contiguous; K even for bfloat16) times the packed [N, K] weight (``pack``), plus
    ``bias`` [N] float32: [M, N] in ``out_dtype`` (x's dtype or float32)."""
    return ops().linear(x, packed, bias, n, out_dtype)


def linear_out(x: torch.Tensor, packed: torch.Tensor, n: int, out: torch.Tensor,
               bias: torch.Tensor | None = None) -> None:
    """``linear`` written into ``out`` ([M, n], x's dtype or float32, unit column stride, any row
    stride: e.g. a column range of the whole logits), with no intermediate tensor and copy."""
    ops().linear_out(x, packed, bias, n, out)
