"""DeepSeek's multi-head latent attention (MLA) over the paged latent cache, in PyTorch.

The cache holds per token ``[c | k_pe]`` (the compressed latent and the shared rotated RoPE key).
Prefill pieces expand their context's latents into per-head keys and values (``kv_b_proj``) and
run ordinary attention; decodes use the absorbed form: the query ``[q_nope W_UK | q_pe]`` attends to
the cached ``[c | k_pe]`` as one shared key head whose values are ``c``, and ``W_UV`` is applied to
the attended latent -- no per-head keys or values are materialized.
"""

from __future__ import annotations

import torch

from afdserve.backends.pytorch.sdpa import sdpa

DECODE_CHUNK = 32  # decode sequences per attention call


def attend(kv, layer, q_nope: torch.Tensor, q_pe: torch.Tensor, cache, ctx) -> torch.Tensor:
    """[T, heads, v_head_dim] attention outputs of the step's tokens (``kv``: how the cache is read,
    ``afdserve.backends.pytorch.kv``; ``layer``: an ``MLAPart``; ``ctx``: a ``TorchContext``, keys
    through window 0)."""
    m, nh, t = layer.mla, layer.nh, q_nope.shape[0]
    if ctx.is_decode:
        return _decode(kv, layer, q_nope, q_pe, cache, *ctx.decode_kv[0])
    out = q_nope.new_empty(t, nh, m.v_head_dim)
    if ctx.decode_rows is not None:
        rows = ctx.decode_rows
        out[rows] = _decode(kv, layer, q_nope[rows], q_pe[rows], cache, *ctx.decode_kv[0])
    for g in ctx.prefill[0]:
        latent = kv.gather(cache, g.slots, q_nope.dtype)  # [P, Lk, r + rope]
        p, kv_len = latent.shape[:2]
        c, k_pe = latent.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        k_nope, v = layer.kv_b_proj(c).view(p, kv_len, nh, -1).split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(p, kv_len, nh, m.qk_rope_head_dim)], dim=-1)
        q = torch.cat([q_nope[g.rows], q_pe[g.rows]], dim=-1)
        qs, ks, vs = (a.transpose(1, 2) for a in (q, k, v))
        o = sdpa(qs, ks, vs, attn_mask=g.mask, is_causal=g.mask is None, scale=m.softmax_scale).transpose(1, 2)
        out[g.dst] = o.flatten(0, 1)[g.src]
    return out


def _decode(kv, layer, q_nope: torch.Tensor, q_pe: torch.Tensor, cache, slots: torch.Tensor,
            mask: torch.Tensor) -> torch.Tensor:
    """Absorbed decode: the scores ``q_nope W_UK c + q_pe k_pe`` against the cached latents, then
    ``W_UV`` on the attended latent."""
    m = layer.mla
    w_uk, w_uv = layer.w_kv_b()
    q = torch.cat([torch.einsum("tnd,ndr->tnr", q_nope, w_uk), q_pe], dim=-1)  # [S, nh, r + rope]
    outs = []
    for s in range(0, q.shape[0], DECODE_CHUNK):
        e = s + DECODE_CHUNK
        keys = kv.gather(cache, slots[s:e], q.dtype)[:, None]  # [S, 1, L, r + rope]: one key head
        # the heads as the queries of that one key head (faster on the CPU than enable_gqa)
        o = sdpa(q[s:e, None], keys, keys[..., : m.kv_lora_rank], attn_mask=mask[s:e], scale=m.softmax_scale)
        outs.append(o[:, 0])
    lat = outs[0] if len(outs) == 1 else torch.cat(outs)  # [S, nh, r]
    return torch.einsum("snr,nvr->snv", lat, w_uv)
