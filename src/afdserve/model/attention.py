"""The attention part of a MoE layer: norms, QKV, RoPE, paged GQA attention, output projection."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from afdserve.model.config import ModelConfig
from afdserve.model.layers import RMSNorm, Rotary


@dataclass
class AttnMetadata:
    """Where the tokens of a flat batch go in the paged KV cache and what they attend to.

    The batch is the concatenation of each sequence's new tokens (``query_lens``); after this
    step sequence ``i`` has ``kv_lens[i]`` tokens in the cache. Sequences with one new token
    (decodes) are attended in one batched call; the others one by one.
    """

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    query_lens: list[int]
    kv_lens: list[int]
    kv_slots: list[torch.Tensor]  # per sequence: [kv_len] cache slots of its whole context
    decode_rows: torch.Tensor | None = None  # token rows of the query_len == 1 sequences
    decode_slots: torch.Tensor | None = None  # [num_decode, max_kv] padded slots
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_kv] bool, True where attended

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @staticmethod
    def build(query_lens: list[int], kv_slots: list[torch.Tensor]) -> "AttnMetadata":
        """``kv_slots[i]``: cache slots of all tokens of sequence i after this step; its last
        ``query_lens[i]`` tokens are the new ones."""
        kv_lens = [int(s.shape[0]) for s in kv_slots]
        q = torch.tensor(query_lens, dtype=torch.int64)
        kv = torch.tensor(kv_lens, dtype=torch.int64)
        seq_of = torch.repeat_interleave(torch.arange(len(query_lens)), q)  # sequence of each token
        first = torch.cumsum(q, 0) - q  # first token row of each sequence
        positions = (kv - q)[seq_of] + torch.arange(int(q.sum())) - first[seq_of]
        padded = torch.nn.utils.rnn.pad_sequence(list(kv_slots), batch_first=True)  # [S, max_kv]
        slot_mapping = padded[seq_of, positions]
        dec = (q == 1).nonzero().squeeze(1)
        rows = slots = mask = None
        if dec.numel():
            rows = first[dec]
            lens = kv[dec]
            slots = padded[dec, : int(lens.max())]
            mask = (torch.arange(slots.shape[1])[None, :] < lens[:, None])[:, None, None, :]
        return AttnMetadata(positions, slot_mapping, list(query_lens), kv_lens, list(kv_slots), rows, slots, mask)


class AttentionPart(nn.Module):
    """``x -> (h, y)`` with ``h = x + attn(norm(x))`` and ``y = post_norm(h)`` (the MoE input)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.qkv = nn.Linear(h, (nh + 2 * nkv) * hd, bias=cfg.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(nh * hd, h, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.scale = hd**-0.5
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttnMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, k, v = self.qkv(self.input_norm(x)).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, k, v = q.view(-1, nh, hd), k.view(-1, nkv, hd), v.view(-1, nkv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
        # caches are [num_slots, nkv, hd] views of the paged blocks
        k_cache[meta.slot_mapping] = k
        v_cache[meta.slot_mapping] = v
        out = self._attend(q, k_cache, v_cache, meta)
        h = x + self.o_proj(out.reshape(-1, nh * hd))
        return h, self.post_norm(h)

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttnMetadata) -> torch.Tensor:
        if meta.decode_rows is not None and meta.decode_rows.shape[0] == q.shape[0]:
            return self._decode(q, k_cache, v_cache, meta)  # pure decode batch
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._decode(q[meta.decode_rows], k_cache, v_cache, meta)
        start = 0
        for qlen, slots in zip(meta.query_lens, meta.kv_slots):
            if qlen == 1:
                start += 1
                continue
            qs = q[start : start + qlen].transpose(0, 1)[None]  # [1, nh, q, hd]
            keys = k_cache[slots].transpose(0, 1)[None]
            vals = v_cache[slots].transpose(0, 1)[None]
            kv_len = slots.shape[0]
            if qlen == kv_len:
                o = F.scaled_dot_product_attention(qs, keys, vals, is_causal=qlen > 1, scale=self.scale,
                                                   enable_gqa=True)
            else:  # new tokens attend to the cached prefix and causally among themselves
                mask = torch.ones(qlen, kv_len, dtype=torch.bool).tril(kv_len - qlen)
                o = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask, scale=self.scale,
                                                   enable_gqa=True)
            out[start : start + qlen] = o[0].transpose(0, 1)
            start += qlen
        return out

    DECODE_CHUNK = 32  # sequences per attention call: keeps the gathered keys/values in cache

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttnMetadata) -> torch.Tensor:
        outs = []
        for s in range(0, q.shape[0], self.DECODE_CHUNK):
            e = s + self.DECODE_CHUNK
            keys = k_cache[meta.decode_slots[s:e]].transpose(1, 2)  # [S, nkv, L, hd]
            vals = v_cache[meta.decode_slots[s:e]].transpose(1, 2)
            o = F.scaled_dot_product_attention(q[s:e, :, None, :], keys, vals, attn_mask=meta.decode_mask[s:e],
                                               scale=self.scale, enable_gqa=True)
            outs.append(o[:, :, 0, :])
        return outs[0] if len(outs) == 1 else torch.cat(outs)
