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


def attention_half(x: torch.Tensor, in_w: torch.Tensor, qkv_w: torch.Tensor, qkv_b: torch.Tensor | None,
                   cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor, heads: int, kv_heads: int, q_w: torch.Tensor | None, k_w: torch.Tensor | None,
                   block_tables: torch.Tensor, kv_lens: torch.Tensor, cu_q: torch.Tensor, block_size: int, window: int,
                   scale: float, sinks: torch.Tensor | None, o_w: torch.Tensor, o_b: torch.Tensor | None,
                   post_w: torch.Tensor, router_w: torch.Tensor | None, experts: int,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention half of a layer in one call (``csrc/attention_half.cpp``): (h, y, router logits)
    as ``rms_norm``, the packed QKV ``linear`` (weights from ``kernels.linear.pack``, float32 biases),
    ``rope_cache``, ``paged_attention``, the output ``linear`` and ``add_rms_norm`` give them, and
    the router's float32 logits of y (rounded to x's dtype first) when ``router_w`` is given (an empty
    tensor otherwise)."""
    return ops().attention_half(x, in_w, qkv_w, qkv_b, cos, sin, k_cache, v_cache, slots, heads, kv_heads, q_w, k_w,
                                block_tables, kv_lens, cu_q, block_size, window, scale, sinks, o_w, o_b, post_w,
                                router_w, experts, eps)
