"""Attention in PyTorch over the paged KV cache: decodes in one SDPA call over their keys gathered
through the block tables, prefill pieces in one padded call per group of similar key counts
(``prefill_groups``); GQA, sliding windows, sinks (gpt-oss), and MLA's latent attention
(``afdserve.backends.pytorch.mla``). Its context is built on the host once per step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from afdserve.backends.base import LinearOp, NormBackend
from afdserve.backends.pytorch import mla
from afdserve.backends.pytorch.kv import PlainKV, kv_access
from afdserve.backends.pytorch.prefill_groups import PrefillGroup, plan
from afdserve.backends.pytorch.sdpa import sdpa
from afdserve.backends.step import AttnContext, StepBuffers, StepLayout


@dataclass
class TorchContext(AttnContext):
    decode_rows: torch.Tensor | None = None  # [D] int64: rows of the sequences with one new token
    # per key window: the decodes' key slots [D, L] (padded with each one's last slot) and mask [D, 1, 1, L]
    decode_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    prefill: dict[int, list[PrefillGroup]] = field(default_factory=dict)  # per key window


class TorchAttention:
    name = "torch"
    latent = True

    def __init__(self, norm: NormBackend, fp8_kv: bool = False):
        self.norm = norm  # RoPE with the cache write
        self.kv = kv_access(fp8_kv)  # how the cache is written and read (afdserve.backends.pytorch.kv)

    def prepare(self, layout: StepLayout, windows: tuple[int, ...], buffers: StepBuffers) -> TorchContext:
        stage = buffers.stage
        ctx = TorchContext(layout, stage("positions", layout.positions), stage("slot_mapping", layout.slot_mapping),
                           layout.num_tokens, layout.is_decode, first_rows=stage("first_rows", layout.first_rows))
        dec = layout.decode_seqs
        if dec.size:
            ctx.decode_rows = stage("decode_rows", layout.first_rows[dec])
            for w in windows:
                slots, mask = _decode_keys(layout, dec, w)
                ctx.decode_kv[w] = (stage(f"decode_slots{w}", slots), stage(f"decode_mask{w}", mask))
        if not layout.is_decode:
            for w in windows:
                groups = plan(layout.query_lens, layout.kv_lens, layout.block_table, layout.block_size, w)
                ctx.prefill[w] = groups if buffers.on_host else [g.to(buffers.device) for g in groups]
        return ctx

    def bind(self, layer, router: LinearOp | None) -> "TorchHalf":
        return TorchHalf(self, layer, router)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: TorchContext, window: int,
               sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
        """q [T, heads, D] of the step's tokens over the paged cache [slots, kv_heads, D]."""
        kv = self.kv
        if ctx.is_decode:
            return _decode(kv, q, k_cache, v_cache, *ctx.decode_kv[window], sinks, scale)
        out = torch.empty_like(q)
        if ctx.decode_rows is not None:
            rows = ctx.decode_rows
            out[rows] = _decode(kv, q[rows], k_cache, v_cache, *ctx.decode_kv[window], sinks, scale)
        for g in ctx.prefill[window]:
            qs = q[g.rows].transpose(1, 2)  # [P, nh, Lq, hd]
            keys = kv.gather(k_cache, g.slots, q.dtype).transpose(1, 2)  # [P, nkv, Lk, hd]
            vals = kv.gather(v_cache, g.slots, q.dtype).transpose(1, 2)
            o = _sdpa(qs, keys, vals, g.mask, sinks, scale)
            out[g.dst] = o.transpose(1, 2).reshape(-1, *q.shape[1:])[g.src]
        return out

    def latent_attention(self, layer, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                         ctx: TorchContext) -> torch.Tensor:
        """MLA (``afdserve.model.mla.MLAPart``): [T, heads, v_head_dim] attention outputs."""
        return mla.attend(self.kv, layer, q_nope, q_pe, cache, ctx)


class TorchHalf:
    """One layer's attention half: its modules' norms and projections (over their backends), RoPE
    with the cache write, ``TorchAttention.attend``, and the router's logits."""

    def __init__(self, backend: TorchAttention, layer, router: LinearOp | None):
        self.backend, self.layer, self.router = backend, layer, router

    def __call__(self, x: torch.Tensor, ctx: TorchContext, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        a = self.layer
        qkv = a.qkv(a.input_norm(x))
        norms = (None, None) if a.q_norm is None else (a.q_norm.weight, a.k_norm.weight)
        q = self.backend.kv.rope_cache(self.backend.norm, qkv, ctx, k_cache, v_cache, a, norms)
        out = self.backend.attend(q, k_cache, v_cache, ctx, a.window, a.sinks, a.scale)
        h, y = a.post_norm.add_forward(a.o_proj(out.reshape(x.shape[0], -1)), x)
        return h, y, None if self.router is None else self.router(y).float()


def _decode_keys(layout: StepLayout, dec: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Key slots [D, L] and mask [D, 1, 1, L] of the decode sequences ``dec`` through ``window``."""
    lens = layout.kv_lens[dec]
    starts = np.maximum(lens - window, 0) if window else np.zeros_like(lens)
    kept = lens - starts
    cols = np.arange(int(kept.max()), dtype=np.int64)[None, :]
    # padded with each sequence's own last position (masked): never a slot of a block it gave back
    pos = starts[:, None] + np.minimum(cols, kept[:, None] - 1)
    bs = layout.block_size
    slots = layout.block_table[dec[:, None], pos // bs].astype(np.int64) * bs + pos % bs
    return slots, (cols < kept[:, None])[:, None, None, :]


def _decode(kv: PlainKV, q: torch.Tensor, k_cache, v_cache, slots: torch.Tensor, mask: torch.Tensor,
            sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [S, nh, hd] of decode sequences over their keys at ``slots`` [S, L] (``mask`` [S, 1, 1, L]):
    each key head's query heads as its queries (the same attention, several times faster on the CPU
    than ``enable_gqa``)."""
    keys = kv.gather(k_cache, slots, q.dtype).transpose(1, 2)  # [S, nkv, L, hd]
    vals = kv.gather(v_cache, slots, q.dtype).transpose(1, 2)
    grouped = q.view(q.shape[0], keys.shape[1], -1, q.shape[-1])  # [S, nkv, heads per kv head, hd]
    return _sdpa(grouped, keys, vals, mask, sinks, scale, gqa=False).reshape(q.shape)


def _sdpa(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor | None,
          sinks: torch.Tensor | None, scale: float, gqa: bool = True) -> torch.Tensor:
    """q [B, Hq, Lq, hd], keys/vals [B, Hk, L, hd] (query head h reads key head h // (Hq / Hk)), mask
    bool broadcastable to [B, Hq, Lq, L] (None: causal with Lq == L). ``sinks`` [Hq]: one more
    value-less logit per head (gpt-oss)."""
    if sinks is None:
        return sdpa(q, keys, vals, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa)
    b, hq, lq, _ = q.shape
    if mask is None:
        mask = torch.ones(lq, keys.shape[2], dtype=torch.bool, device=q.device).tril()
    # the sink: one more key (zero, so its logit is the bias sinks[head]) with a zero value
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    bias = torch.cat([bias.expand(b, hq, lq, -1), sinks.to(q.dtype).view(1, hq, -1, 1).expand(b, hq, lq, 1)], dim=-1)
    zero = keys.new_zeros(b, keys.shape[1], 1, keys.shape[3])
    return sdpa(q, torch.cat([keys, zero], 2), torch.cat([vals, zero], 2), attn_mask=bias, scale=scale,
                enable_gqa=gqa)
