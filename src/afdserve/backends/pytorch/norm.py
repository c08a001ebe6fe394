"""RMS norm and RoPE with the KV-cache write in PyTorch."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotation (Llama/Mixtral/Qwen/gpt-oss) of ``x`` [T, heads, D] by cos/sin [T, R]:
    the first R dimensions rotate, the others (partial rotary) pass through."""
    r = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = (x, None) if r == x.shape[-1] else (x[..., :r], x[..., r:])
    half = r // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return out if rest is None else torch.cat((out, rest), dim=-1)


class TorchNorm:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, w, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + residual
        return h, rms_norm(h, w, eps)

    def rope_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slots: torch.Tensor, heads: int, kv_heads: int,
                   q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
        d = k_cache.shape[-1]
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q, k, v = q.view(-1, heads, d), k.view(-1, kv_heads, d), v.view(-1, kv_heads, d)
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_cache[slots] = k
        v_cache[slots] = v
        return q
