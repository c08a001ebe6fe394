"""Scaled dot-product attention with the workaround CUDA's fused kernels need."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """``F.scaled_dot_product_attention``; on CUDA, inputs whose rows do not start on 16-byte
    boundaries (a slice of wider rows, an odd head dimension) go through the math backend: the
    fused kernels load them 16 bytes at a time (seen on an H200 with the tiny DeepSeek-V3 test
    shapes, values sliced at an offset of 10 float32 columns: "misaligned address")."""
    if q.is_cuda and not torch.compiler.is_compiling() and not all(_rows_aligned(t) for t in (q, k, v)):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, **kw)
    return F.scaled_dot_product_attention(q, k, v, **kw)


def _rows_aligned(t: torch.Tensor) -> bool:
    n = t.element_size()
    return t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and t.shape[-1] * n % 16 == 0 and all(
        s * n % 16 == 0 for s, d in zip(t.stride()[:-1], t.shape[:-1]) if d > 1)
