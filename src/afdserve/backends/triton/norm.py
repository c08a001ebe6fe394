"""The ``triton`` norm backend: RMS norm with the residual add, and RoPE (with Qwen3's per-head q/k
norms) with the KV-cache write, one Triton launch each (``norm_kernels``), as custom ops with fake
implementations so compile and graphs take them whole."""

from __future__ import annotations

import torch

from afdserve.backends.triton import load


class TritonNorm:
    name = "triton"

    def __init__(self, device: torch.device):
        load(device, "norm_kernels")

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, w, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, w, eps)

    def rope_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slots: torch.Tensor, heads: int, kv_heads: int,
                   q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
        return rope_cache(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, q_norm, k_norm, eps)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as rows [M, N] with unit column stride (a copy only where it has none)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _norm(x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float) -> tuple:
    kernels = load(x.device, "norm_kernels")
    rows, res = _rows(x), None if residual is None else _rows(residual)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    h = torch.empty_like(out) if residual is not None else out
    if rows.shape[0]:
        kernels.rms_norm_kernel[(rows.shape[0],)](
            out, h, rows, rows if res is None else res, w, rows.shape[1], rows.stride(0),
            rows.stride(0) if res is None else res.stride(0), eps, ADD=res is not None, BLOCK=_pow2(rows.shape[1]))
    return h.view(x.shape), out.view(x.shape)


@torch.library.custom_op("afdserve::triton_rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32, the weight applied in x's dtype."""
    return _norm(x, None, w, eps)[1]


@rms_norm.register_fake
def _(x, w, eps):
    return torch.empty_like(x)


@torch.library.custom_op("afdserve::triton_add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h)) with h = x + residual."""
    return _norm(x, residual, w, eps)


@add_rms_norm.register_fake
def _(x, residual, w, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("afdserve::triton_rope_cache", mutates_args=("k_cache", "v_cache"))
def rope_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, slots: torch.Tensor, heads: int, kv_heads: int,
               q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The queries [T, heads, D] of ``qkv`` [T, (heads + 2 kv_heads) * D] rotated (and normalized per
    head where norms are given); its keys and values written into the caches at ``slots``."""
    kernels = load(qkv.device, "norm_kernels")
    d = k_cache.shape[-1]
    t = qkv.shape[0]
    qkv = _rows(qkv)
    cos, sin = _rows(cos), _rows(sin)
    q = torch.empty(t, heads, d, dtype=qkv.dtype, device=qkv.device)
    if t:
        norm = q_norm is not None
        kernels.rope_cache_kernel[(t,)](
            q, qkv, cos, sin, k_cache, v_cache, slots, q_norm if norm else cos, k_norm if norm else cos,
            qkv.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            eps, HEADS=heads, KV_HEADS=kv_heads, D=d, R=cos.shape[1], H_PAD=_pow2(heads), KV_PAD=_pow2(kv_heads),
            D_PAD=_pow2(d), NORM=norm)
    return q


@rope_cache.register_fake
def _(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, q_norm, k_norm, eps):
    return qkv.new_empty(qkv.shape[0], heads, k_cache.shape[-1])
