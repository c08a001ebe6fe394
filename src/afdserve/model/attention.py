"""The attention part of a MoE layer: norms, QKV, RoPE, paged GQA attention, output projection --
its weights; the computation is the attention backend's, bound once (``bind``)."""

from __future__ import annotations

import torch
from torch import nn

from afdserve.backends import Backends
from afdserve.backends.base import AttentionHalf, LinearOp
from afdserve.backends.step import AttnContext
from afdserve.model.config import ModelConfig
from afdserve.model.layers import RMSNorm
from afdserve.model.linear import Linear


class AttentionPart(nn.Module):
    """``x -> (h, y)`` with ``h = x + attn(norm(x))`` and ``y = post_norm(h)`` (the MoE input).

    ``window``: keys attended (0: all). With ``cfg.attention_sinks`` (gpt-oss) every head's softmax
    also has a learned logit ``sinks[head]`` that takes weight and adds no value."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, window: int = 0):
        super().__init__()
        self.cfg, self.window = cfg, window
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = nh, nkv, hd, cfg.rms_norm_eps
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.qkv = Linear(h, (nh + 2 * nkv) * hd, bias=cfg.qkv_bias, dtype=dtype)
        self.o_proj = Linear(nh * hd, h, bias=cfg.o_proj_bias, dtype=dtype)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(nh, dtype=dtype)) if cfg.attention_sinks else None
        self.scale = hd**-0.5
        self.half: AttentionHalf | None = None
        self.requires_grad_(False)

    def bind(self, backends: Backends, router: LinearOp | None = None) -> None:
        """Binds the (prepared) layer to the attention backend, with the router whose logits it
        computes along (``forward``'s third result; None: none)."""
        self.half = backends.attention.bind(self, router)

    def forward(self, x: torch.Tensor, ctx: AttnContext, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(h, y, the bound router's float32 logits of y or None); x [T, H] of the step ``ctx``;
        caches [slots, kv_heads, head_dim] (the layer's views of the paged blocks)."""
        return self.half(x, ctx, k_cache, v_cache)
