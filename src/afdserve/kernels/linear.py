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


def linear_argmax(x: torch.Tensor, packed: torch.Tensor, n: int, offset: int = 0, bias: torch.Tensor | None = None,
                  into: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``linear(x, packed, n, bias, float32)``: its largest value (float32 [M]) and that
    column plus ``offset`` (int64 [M]), ``torch.argmax``'s choice (the first maximum; a NaN counts as
    the largest), without writing the outputs anywhere. ``into``: a (values, indices) pair, index -1
    for none, updated in place where this call's choice beats theirs (the pieces of one argmax, in
    any order)."""
    if into is None:
        val, idx = torch.empty(x.shape[0], dtype=torch.float32), torch.empty(x.shape[0], dtype=torch.int64)
    else:
        val, idx = into
    ops().linear_argmax(x, packed, bias, n, offset, val, idx, into is not None)
    return val, idx
