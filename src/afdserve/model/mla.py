"""DeepSeek's multi-head latent attention (MLA) over the paged latent cache.

Per token and layer the cache holds ``[c | k_pe]``: the compressed latent ``c`` (``kv_lora_rank``,
after ``kv_a_layernorm``) and the decoupled RoPE key ``k_pe`` (``qk_rope_head_dim``, rotated), shared
by all heads. Keys and values of head n are ``k_n = [W_UK_n c | k_pe]`` and ``v_n = W_UV_n c``
(``kv_b_proj`` stacks W_UK and W_UV per head).

* Prefill (a sequence with several new tokens) expands its context's latents into per-head keys
  and values and runs ordinary attention.
* Decode uses the absorbed form: the query becomes ``[q_nope W_UK_n | q_pe]`` (W_UK folded into
  it), attends to the cached ``[c | k_pe]`` directly as one shared key head whose values are ``c``,
  and W_UV is applied to the attention output — no per-head keys or values are materialized.
"""

from __future__ import annotations

import torch
from torch import nn

from afdserve.model.attention import AttnMetadata
from afdserve.model.config import ModelConfig
from afdserve.model.layers import RMSNorm, sdpa
from afdserve.model.linear import Linear
from afdserve.model.loader import CheckpointReader
from afdserve.model.rope import apply_rotary

LORA_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's RoPE on interleaved pairs (x0, x1), (x2, x3)...: ``x`` [T, heads, R], cos/sin
    [T, R] (``cat(freqs, freqs)``). The result is laid out de-interleaved (evens' rotation, then
    odds'), as transformers does: the same for queries and keys, so their dot products are those
    of the interleaved rotation."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLAPart(nn.Module):
    """``x -> (h, y)`` with ``h = x + mla(norm(x))`` and ``y = post_norm(h)``, like ``AttentionPart``,
    over a latent cache ``[num_slots, kv_lora_rank + qk_rope_head_dim]``."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        mla = cfg.mla
        if mla is None:
            raise ValueError("MLAPart needs a config with MLA shapes")
        self.mla, self.nh = mla, cfg.num_heads
        h, nh, bias = cfg.hidden_size, cfg.num_heads, mla.attention_bias
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        if mla.q_lora_rank is None:
            self.q_proj = Linear(h, nh * mla.qk_head_dim, bias=False, dtype=dtype)
        else:
            self.q_a_proj = Linear(h, mla.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_norm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS, dtype)
            self.q_b_proj = Linear(mla.q_lora_rank, nh * mla.qk_head_dim, bias=False, dtype=dtype)
        self.kv_a_proj = Linear(h, mla.latent_dim, bias=bias, dtype=dtype)
        self.kv_a_norm = RMSNorm(mla.kv_lora_rank, LORA_NORM_EPS, dtype)
        self.kv_b_proj = Linear(mla.kv_lora_rank, nh * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False,
                                   dtype=dtype)
        self.o_proj = Linear(nh * mla.v_head_dim, h, bias=bias, dtype=dtype)
        self.requires_grad_(False)

    def load(self, r: CheckpointReader, prefix: str, dtype: torch.dtype) -> None:
        """Reads the layer ``prefix`` (``model.layers.N.``): its norms and ``self_attn``."""
        own = {"input_norm.weight": "input_layernorm.weight", "post_norm.weight": "post_attention_layernorm.weight",
               "q_a_norm.weight": "self_attn.q_a_layernorm.weight",
               "kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
               "kv_a_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
               "kv_a_proj.bias": "self_attn.kv_a_proj_with_mqa.bias"}
        for name, t in self.state_dict().items():
            t.copy_(r.get(prefix + own.get(name, "self_attn." + name), tuple(t.shape), dtype))

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttnMetadata,
                cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m, nh, t = self.mla, self.nh, x.shape[0]
        hn = self.input_norm(x)
        q = self.q_proj(hn) if m.q_lora_rank is None else self.q_b_proj(self.q_a_norm(self.q_a_proj(hn)))
        q_nope, q_pe = q.view(t, nh, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c, k_pe = self.kv_a_proj(hn).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        cos, sin = cos_sin
        rotate = rotate_interleaved if m.rope_interleave else apply_rotary
        q_pe, k_pe = rotate(q_pe, cos, sin), rotate(k_pe[:, None, :], cos, sin)[:, 0]
        cache[meta.slot_mapping] = torch.cat([self.kv_a_norm(c), k_pe], dim=-1)
        out = self._attend(q_nope, q_pe, cache, meta)
        h = x + self.o_proj(out.reshape(t, nh * m.v_head_dim))
        return h, self.post_norm(h)

    def _w_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [nh, nope, r] and W_UV [nh, v, r]."""
        m = self.mla
        w = self.kv_b_proj.weight.view(self.nh, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]

    def _attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                meta: AttnMetadata) -> torch.Tensor:
        """[T, nh, v_head_dim] attention outputs of the flat batch."""
        t = q_nope.shape[0]
        if meta.decode_rows is not None and meta.decode_rows.shape[0] == t:
            return self._decode(q_nope, q_pe, cache, meta)  # pure decode batch
        out = q_nope.new_empty(t, self.nh, self.mla.v_head_dim)
        if meta.decode_rows is not None:
            rows = meta.decode_rows
            out[rows] = self._decode(q_nope[rows], q_pe[rows], cache, meta)
        for g in meta.prefill_groups():
            out[g.dst] = self._prefill(q_nope[g.rows], q_pe[g.rows], cache[g.slots], g.mask).flatten(0, 1)[g.src]
        return out

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        """A group of prefill pieces (``AttnMetadata.prefill_groups``): their new tokens [P, Lq, nh, *]
        over their contexts ``latent`` [P, Lk, r + rope], expanded; [P, Lq, nh, v_head_dim]."""
        m, nh = self.mla, self.nh
        p, kv_len = latent.shape[:2]
        c, k_pe = latent.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        k_nope, v = self.kv_b_proj(c).view(p, kv_len, nh, -1).split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(p, kv_len, nh, m.qk_rope_head_dim)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        qs, ks, vs = (a.transpose(1, 2) for a in (q, k, v))
        o = sdpa(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=m.softmax_scale)
        return o.transpose(1, 2)

    DECODE_CHUNK = 32  # sequences per attention call

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                meta: AttnMetadata) -> torch.Tensor:
        """Absorbed decode: the scores ``q_nope W_UK c + q_pe k_pe`` against the cached latents,
        then ``W_UV`` on the attended latent."""
        m = self.mla
        w_uk, w_uv = self._w_kv_b()
        q = torch.cat([torch.einsum("tnd,ndr->tnr", q_nope, w_uk), q_pe], dim=-1)  # [S, nh, r + rope]
        outs = []
        for s in range(0, q.shape[0], self.DECODE_CHUNK):
            e = s + self.DECODE_CHUNK
            keys = cache[meta.decode_slots[s:e]][:, None]  # [S, 1, L, r + rope]: one key head
            # the heads as the queries of that one key head (faster on CPU than enable_gqa)
            o = sdpa(q[s:e, None], keys, keys[..., : m.kv_lora_rank], attn_mask=meta.decode_mask[s:e],
                     scale=m.softmax_scale)
            outs.append(o[:, 0])
        lat = outs[0] if len(outs) == 1 else torch.cat(outs)  # [S, nh, r]
        return torch.einsum("snr,nvr->snv", lat, w_uv)
