"""RMS norm (with the residual add) and RoPE with the KV-cache write, as kernels."""

from __future__ import annotations

import torch

from afdserve.backends.cpu import ops


class CpuNorm:
    name = "cpu"

    def __init__(self):
        k = ops.ops()
        self._rms, self._add_rms, self._rope = k.rms_norm, k.add_rms_norm, k.rope_cache

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rms(x.reshape(-1, x.shape[-1]).contiguous(), w, eps).view(x.shape)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._add_rms(x.contiguous(), residual.contiguous(), w, eps)

    def rope_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slots: torch.Tensor, heads: int, kv_heads: int,
                   q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
        return self._rope(qkv.contiguous(), cos, sin, k_cache, v_cache, slots, heads, kv_heads, q_norm, k_norm, eps)
