"""DeepSeek's multi-head latent attention (MLA) over the paged latent cache.

Per token and layer the cache holds ``[c | k_pe]``: the compressed latent ``c`` (``kv_lora_rank``,
after ``kv_a_layernorm``) and the decoupled RoPE key ``k_pe`` (``qk_rope_head_dim``, rotated), shared
by all heads. Keys and values of head n are ``k_n = [W_UK_n c | k_pe]`` and ``v_n = W_UV_n c``
(``kv_b_proj`` stacks W_UK and W_UV per head).

The attention over the cache is the attention backend's (``latent_attention``; the torch
backend's ``afdserve.backends.pytorch.mla``): prefills expand the latents, decodes use the absorbed
form.
"""

from __future__ import annotations

import torch
from torch import nn

from afdserve.backends import Backends
from afdserve.backends.pytorch.norm import apply_rotary
from afdserve.backends.step import AttnContext
from afdserve.errors import ConfigError
from afdserve.model.config import ModelConfig
from afdserve.model.layers import RMSNorm
from afdserve.model.linear import Linear
from afdserve.model.loader import CheckpointReader

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
        self.attn = None  # the attention backend (``bind``)
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

    def bind(self, backends: Backends) -> None:
        """The latent attention of the attention backend (the torch one: ``afdserve.backends.choose``)."""
        if not backends.attention.latent:
            raise ConfigError(f"the {backends.attention.name} attention backend does not run MLA; use the torch one")
        self.attn = backends.attention

    def project(self, x: torch.Tensor, ctx: AttnContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's queries and latents from its tokens x [T, H]: (q_nope [T, heads, nope], q_pe
        [T, heads, rope] rotated, the latents ``[c | k_pe]`` [T, latent_dim] as the cache holds them)."""
        m, nh, t = self.mla, self.nh, x.shape[0]
        hn = self.input_norm(x)
        q = self.q_proj(hn) if m.q_lora_rank is None else self.q_b_proj(self.q_a_norm(self.q_a_proj(hn)))
        q_nope, q_pe = q.view(t, nh, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c, k_pe = self.kv_a_proj(hn).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        rotate = rotate_interleaved if m.rope_interleave else apply_rotary
        q_pe, k_pe = rotate(q_pe, ctx.cos, ctx.sin), rotate(k_pe[:, None, :], ctx.cos, ctx.sin)[:, 0]
        return q_nope, q_pe, torch.cat([self.kv_a_norm(c), k_pe], dim=-1)

    def forward(self, x: torch.Tensor, ctx: AttnContext, cache) -> tuple[torch.Tensor, torch.Tensor]:
        m, nh, t = self.mla, self.nh, x.shape[0]
        q_nope, q_pe, latent = self.project(x, ctx)
        self.attn.kv.write(cache, ctx, latent)
        out = self.attn.latent_attention(self, q_nope, q_pe, cache, ctx)
        h = x + self.o_proj(out.reshape(t, nh * m.v_head_dim))
        return h, self.post_norm(h)

    def w_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [nh, nope, r] and W_UV [nh, v, r]."""
        m = self.mla
        w = self.kv_b_proj.weight.view(self.nh, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]
