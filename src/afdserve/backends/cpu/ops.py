"""The kernels' calls (``csrc/``) and the packed weight layout of their GEMMs: column blocks of 32
outputs (bfloat16: pairs of consecutive k)."""

from __future__ import annotations

import torch

BLOCK = 32  # outputs per column block (the kernels' NB)
ACTIVATIONS = {"silu": 0, "swiglu_oai": 1}


def available() -> bool:
    from afdserve.backends.cpu.build import load

    return load().ok


def ops():
    """``torch.ops.afdserve_kernels`` (loaded); RuntimeError naming the reason if unavailable."""
    from afdserve.backends.cpu.build import load

    state = load()
    if not state.ok:
        raise RuntimeError(f"afdserve kernels unavailable: {state.reason}")
    return torch.ops.afdserve_kernels


def blocks(w: torch.Tensor) -> torch.Tensor:
    """[E, N, K] with N a multiple of 32 -> [E, N/32, K/2, 32, 2] (bfloat16) or [E, N/32, K, 32] (float32)."""
    e, n, k = w.shape
    b = w.reshape(e, n // BLOCK, BLOCK, k)
    if w.dtype == torch.bfloat16:
        return b.reshape(e, n // BLOCK, BLOCK, k // 2, 2).permute(0, 1, 3, 2, 4).contiguous()
    return b.permute(0, 1, 3, 2).contiguous()


def pack(w: torch.Tensor) -> torch.Tensor:
    """A linear weight [N, K] -> the kernel's column blocks (N padded with zero rows to a multiple of 32)."""
    n, k = w.shape
    npad = -(-n // BLOCK) * BLOCK
    if npad != n:
        w = torch.cat([w, w.new_zeros(npad - n, k)])
    return blocks(w.contiguous()[None])[0]


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, stream: bool = False) -> torch.Tensor:
    """x [M, K] (contiguous; K even for bfloat16) times the packed [N, K] weight, plus ``bias`` [N]
    float32: [M, N] in ``out_dtype`` (x's dtype or float32); with ``stream``, a float32 output of
    2 MiB or more is written past the caches (logits read once, later)."""
    return ops().linear(x, packed, bias, n, out_dtype, stream)


def linear_argmax(x: torch.Tensor, packed: torch.Tensor, n: int, offset: int = 0, bias: torch.Tensor | None = None,
                  into: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``linear(x, packed, n, bias, float32)``: its largest value (float32 [M]) and that
    column plus ``offset`` (int64 [M]), ``torch.argmax``'s choice (the first maximum; a NaN counts as
    the largest), without writing the outputs anywhere. ``into``: a (values, indices) pair, index -1
    for none, updated in place where this call's choice beats theirs (pieces of one argmax, any order)."""
    if into is None:
        val, idx = torch.empty(x.shape[0], dtype=torch.float32), torch.empty(x.shape[0], dtype=torch.int64)
    else:
        val, idx = into
    ops().linear_argmax(x, packed, bias, n, offset, val, idx, into is not None)
    return val, idx


def pack_gate_up(w: torch.Tensor) -> torch.Tensor:
    """[E, 2I, H] gate rows then up rows -> blocks holding 16 gate and the matching 16 up rows."""
    e, two_i, h = w.shape
    i = two_i // 2
    ipad = -(-i // 16) * 16
    gate = torch.zeros(e, ipad, h, dtype=w.dtype, device=w.device)
    up = torch.zeros_like(gate)
    gate[:, :i], up[:, :i] = w[:, :i], w[:, i:]
    rows = torch.cat([gate.view(e, ipad // 16, 16, h), up.view(e, ipad // 16, 16, h)], dim=2)
    return blocks(rows.reshape(e, 2 * ipad, h))


def pack_down(w: torch.Tensor) -> torch.Tensor:
    """[E, H, I] -> blocks of 32 hidden outputs over I rounded up to 16 (zeros past I)."""
    e, h, i = w.shape
    hpad, ipad = -(-h // BLOCK) * BLOCK, -(-i // 16) * 16
    padded = torch.zeros(e, hpad, ipad, dtype=w.dtype, device=w.device)
    padded[:, :h, :i] = w
    return blocks(padded)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              local: torch.Tensor, inter: int, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
              activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
              counts: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` over the pairs whose expert is held
    (``local[id]`` >= 0: its index in the packed weights; ids past ``local`` or mapped to -1 give 0).
    x [T, H] (H even); w13, w2 from ``pack_gate_up`` / ``pack_down``; ids [T, k] int32/int64;
    weights [T, k] float32; biases [E, 2I] / [E, H] float32; ``counts`` (int64 [n]): each pair's id
    in [0, n) counted into it."""
    return ops().fused_moe(x, w13, w2, b13, b2, ids, weights, local, inter, ACTIVATIONS[activation], alpha, limit,
                           counts)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    kv_lens: torch.Tensor, cu_q: torch.Tensor, block_size: int, window: int, scale: float,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a varlen batch over the paged cache, read in place. q [T, heads, head_dim]
    (contiguous); caches [slots, kv_heads, head_dim]; block_tables [S, max_blocks] int32 (-1: none);
    kv_lens [S] int32 (each sequence's context after this step); cu_q [S + 1] int32 (sequence s owns
    query rows cu_q[s]..cu_q[s+1]-1, the last tokens of its context). A query at position p attends
    keys [max(0, p - window + 1), p] (window 0: [0, p]); ``sinks`` [heads] float32 adds one
    value-less logit per head."""
    return ops().paged_attention(q, k_cache, v_cache, block_tables, kv_lens, cu_q, block_size, window, scale, sinks)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return ops().rms_norm(x, w, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return ops().add_rms_norm(x, residual, w, eps)


def rope_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slots: torch.Tensor, heads: int, kv_heads: int, q_norm: torch.Tensor | None = None,
               k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """The queries [T, heads, D] of ``qkv``; its keys and values written into the caches at ``slots``
    (q and k RMS-normalized per head with ``q_norm``/``k_norm``, then rotated half-split over the
    first ``cos.shape[1]`` dimensions)."""
    return ops().rope_cache(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, q_norm, k_norm, eps)


def attention_half(*args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention half of a layer in one call (``csrc/attention_half.cpp``): (h, y, router logits)
    as ``rms_norm``, the packed QKV ``linear``, ``rope_cache``, ``paged_attention``, the output
    ``linear`` and ``add_rms_norm`` give them, and the router's float32 logits of y when its packed
    weight is given (empty otherwise). Arguments: x, in_w, qkv_w, qkv_b, cos, sin, k_cache, v_cache,
    slots, heads, kv_heads, q_w, k_w, block_tables, kv_lens, cu_q, block_size, window, scale, sinks,
    o_w, o_b, post_w, router_w, experts, eps."""
    return ops().attention_half(*args)
