"""RMS norm (with the residual add) and RoPE with the KV-cache write in Triton: one launch each where
PyTorch takes several. Imported only through ``afdserve.backends.triton.load_norm``, which decides
interpreted (CPU tensors) or compiled (CUDA) before the kernels are defined."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(out_ptr, h_ptr, x_ptr, res_ptr, w_ptr, n_cols, x_stride, res_stride, eps,
                    ADD: tl.constexpr, BLOCK: tl.constexpr):
    """One row: h = x (+ residual, in x's dtype), written to ``h_ptr`` when ADD; out = w *
    (h * rsqrt(mean(h^2) + eps)) with the normalized row rounded to x's dtype before the weight."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    # arithmetic in float32, rounded where PyTorch rounds (its half-precision ops compute in float32)
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0)
    dtype = x.dtype
    if ADD:
        r = tl.load(res_ptr + row * res_stride + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(h_ptr + row * n_cols + cols, x, mask=ok)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    y = (h * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (w * y).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _heads(base, rows, n_rows, norm_ptr, cos, sin, eps, D: tl.constexpr, R: tl.constexpr, NORM: tl.constexpr,
           D_PAD: tl.constexpr, DTYPE: tl.constexpr):
    """Heads ``rows`` [H_PAD] of D values at ``base`` (float32 out): RMS-normalized per head (NORM,
    rounded to DTYPE before the weight, as the torch backend does) and rotated half-split over
    their first R dims by cos/sin [D_PAD]; the rest pass through."""
    d = tl.arange(0, D_PAD)
    half: tl.constexpr = R // 2
    partner = tl.where(d < half, d + half, d - half)  # rotate_half's source of each rotated dim
    partner = tl.where(d < R, partner, d)
    ok = (rows < n_rows)[:, None] & (d < D)[None, :]
    x = tl.load(base + rows[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(base + rows[:, None] * D + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        w = tl.load(norm_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        wp = tl.load(norm_ptr + partner, mask=d < D, other=0.0).to(tl.float32)
        x = (w[None, :] * (x * rstd[:, None]).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
        xp = (wp[None, :] * (xp * rstd[:, None]).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
    sign = tl.where(d < half, -1.0, 1.0)
    return tl.where((d < R)[None, :], x * cos[None, :] + sign[None, :] * xp * sin[None, :], x)


@triton.jit
def rope_cache_kernel(q_out_ptr, qkv_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, q_norm_ptr,
                      k_norm_ptr, qkv_stride, cos_stride, k_stride0, k_stride1, v_stride0, v_stride1, eps,
                      HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                      H_PAD: tl.constexpr, KV_PAD: tl.constexpr, D_PAD: tl.constexpr, NORM: tl.constexpr):
    """One token: its queries normalized (NORM) and rotated into ``q_out`` [T, HEADS, D], its keys
    likewise and its values written into the caches at its slot."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    cos = tl.load(cos_ptr + t * cos_stride + d, mask=d < R, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * cos_stride + d, mask=d < R, other=0.0).to(tl.float32)
    row = qkv_ptr + t * qkv_stride
    dtype = q_out_ptr.dtype.element_ty

    h = tl.arange(0, H_PAD)
    q = _heads(row, h, HEADS, q_norm_ptr, cos, sin, eps, D, R, NORM, D_PAD, dtype)
    tl.store(q_out_ptr + t * HEADS * D + h[:, None] * D + d[None, :], q.to(dtype),
             mask=(h < HEADS)[:, None] & d_ok[None, :])

    slot = tl.load(slots_ptr + t).to(tl.int64)
    g = tl.arange(0, KV_PAD)
    ok = (g < KV_HEADS)[:, None] & d_ok[None, :]
    k = _heads(row + HEADS * D, g, KV_HEADS, k_norm_ptr, cos, sin, eps, D, R, NORM, D_PAD, dtype)
    tl.store(k_cache_ptr + slot * k_stride0 + g[:, None] * k_stride1 + d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    v = tl.load(row + (HEADS + KV_HEADS) * D + g[:, None] * D + d[None, :], mask=ok, other=0.0)
    tl.store(v_cache_ptr + slot * v_stride0 + g[:, None] * v_stride1 + d[None, :], v, mask=ok)
