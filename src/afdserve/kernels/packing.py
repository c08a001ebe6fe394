"""The packed weight layout of the GEMM kernels (``csrc/gemm.h``): column blocks of 32 outputs."""

from __future__ import annotations

import torch

BLOCK = 32  # outputs per column block (the kernels' NB)


def blocks(w: torch.Tensor) -> torch.Tensor:
    """[E, N, K] with N a multiple of 32 -> [E, N/32, K/2, 32, 2] (bfloat16: pairs of consecutive k)
    or [E, N/32, K, 32] (float32)."""
    e, n, k = w.shape
    b = w.reshape(e, n // BLOCK, BLOCK, k)
    if w.dtype == torch.bfloat16:
        return b.reshape(e, n // BLOCK, BLOCK, k // 2, 2).permute(0, 1, 3, 2, 4).contiguous()
    return b.permute(0, 1, 3, 2).contiguous()
