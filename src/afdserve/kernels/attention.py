"""The paged attention kernel's call (``csrc/attention.cpp``)."""

from __future__ import annotations

import torch

from afdserve.kernels import ops


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    kv_lens: torch.Tensor, cu_q: torch.Tensor, block_size: int, window: int, scale: float,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a varlen batch over the paged cache, read in place.

    q [T, heads, head_dim] (contiguous); k_cache / v_cache [slots, kv_heads, head_dim]; block_tables
    [S, max_blocks] int32 (-1: no block); kv_lens [S] int32: each sequence's context after this
    step; cu_q [S + 1] int32: sequence s owns query rows cu_q[s]..cu_q[s+1]-1, the last tokens of its
    context. A query at position p attends keys [max(0, p - window + 1), p] (window 0: [0, p]);
    ``sinks`` [heads] float32 adds one value-less logit per head (gpt-oss)."""
    return ops().paged_attention(q, k_cache, v_cache, block_tables, kv_lens, cu_q, block_size, window, scale, sinks)
