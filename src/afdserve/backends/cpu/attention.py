"""The attention half of a layer in one kernel call: norm, the packed QKV projection, RoPE with the
KV-cache write, paged attention over the cache read in place through the block tables (prefills and
decodes of a step together), the output projection, the residual and the post-attention norm, and
the router's logits (``csrc/attention_half.cpp``). Its context: the block tables, each sequence's
context length and the query offsets, as int32."""

from __future__ import annotations

import torch

from afdserve.backends.base import LinearOp
from afdserve.backends.cpu import ops
from afdserve.backends.cpu.linear import KernelLinearOp
from afdserve.backends.step import PagedContext, StepBuffers, StepLayout
from afdserve.errors import ConfigError


class FusedHalf:
    """One layer's attention half over its packed weights (bound once, when the model is prepared)."""

    def __init__(self, layer, router: LinearOp | None):
        for name in ("qkv", "o_proj"):
            if not isinstance(getattr(layer, name).op, KernelLinearOp):
                raise ConfigError(f"the cpu attention backend needs the cpu linear backend's packed {name} weight "
                                  f"(dtype {layer.qkv.weight.dtype}, shape {tuple(getattr(layer, name).weight.shape)})")
        if router is not None and not isinstance(router, KernelLinearOp):
            router = None  # the router's logits are then computed apart (``Router``)
        self.layer, self.router = layer, router
        self.sinks = None if layer.sinks is None else layer.sinks.float()
        self.norms = (None, None) if layer.q_norm is None else (layer.q_norm.weight, layer.k_norm.weight)
        self._half = ops.ops().attention_half

    @property
    def fuses_router(self) -> bool:
        return self.router is not None

    def __call__(self, x: torch.Tensor, ctx: PagedContext, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        a, r = self.layer, self.router
        qkv, o = a.qkv.op, a.o_proj.op
        h, y, logits = self._half(
            x.contiguous(), a.input_norm.weight, qkv.packed, qkv.bias, ctx.cos, ctx.sin, k_cache, v_cache,
            ctx.slot_mapping, a.num_heads, a.num_kv_heads, *self.norms, ctx.block_tables, ctx.kv_lens, ctx.cu_q,
            ctx.block_size, a.window, a.scale, self.sinks, o.packed, o.bias, a.post_norm.weight,
            None if r is None else r.packed, 0 if r is None else r.out_features, a.eps)
        return h, y, None if r is None else logits


class CpuAttention:
    name = "cpu"
    latent = False  # MLA runs on the torch attention backend

    def prepare(self, layout: StepLayout, windows: tuple[int, ...], buffers: StepBuffers) -> PagedContext:
        return PagedContext.staged(layout, buffers)

    def bind(self, layer, router: LinearOp | None) -> FusedHalf:
        return FusedHalf(layer, router)
