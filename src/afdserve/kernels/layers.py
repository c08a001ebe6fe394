"""Calls of the per-layer kernels (``csrc/layers.cpp``): RMS norm (with the residual add) and
RoPE with the KV cache write."""

from __future__ import annotations

import torch

from afdserve.kernels import ops


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T, D] with weight ``w``."""
    return ops().rms_norm(x, w, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, RMSNorm(h)) with h = x + residual; x [T, D]."""
    return ops().add_rms_norm(x, residual, w, eps)


def rope_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, slots: torch.Tensor, heads: int, kv_heads: int,
               q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
               eps: float = 1e-6) -> torch.Tensor:
    """The queries [T, heads, D] of ``qkv`` [T, (heads + 2 kv_heads) * D], its keys and values written
    into the caches [slots, kv_heads, D] at ``slots``: q and k RMS-normalized per head (with
    ``q_norm`` / ``k_norm`` weights, Qwen3) and rotated (half-split, the first ``cos.shape[1]``
    dimensions)."""
    return ops().rope_cache(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, q_norm, k_norm, eps)
