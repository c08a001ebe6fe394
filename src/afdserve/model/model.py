"""The two halves of a MoE model: what an attention worker holds and what an expert worker holds.

``AttentionModel`` has the embeddings, every layer's attention part and router (and shared expert),
the final norm and the LM head. ``ExpertModel`` has, for every layer, the routed experts it was
given. Each is loaded from the checkpoint reading only its own tensors.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

from afdserve.backends import Backends
from afdserve.backends.base import Ring, ShardPeers
from afdserve.backends.pytorch.cp_decode import shard_partial, sharded_attention, sharded_latent
from afdserve.backends.pytorch.cp_half import cp_attention, cp_latent
from afdserve.backends.pytorch.ring import RingAttention
from afdserve.backends.step import AttnContext, CPContext, ShardedContext, StepBuffers, StepLayout
from afdserve.errors import ModelError
from afdserve.kvcache.cache import KVCache
from afdserve.model.attention import AttentionPart
from afdserve.model.config import ModelConfig
from afdserve.model.dense import DenseMLP
from afdserve.model.experts import ExpertPart, SharedExpert
from afdserve.model import gpt_oss_weights
from afdserve.model.layers import RMSNorm, prepare_all
from afdserve.model.linear import Linear
from afdserve.model.loader import CheckpointReader, parse_dtype
from afdserve.model.mla import MLAPart
from afdserve.model.rope import Rope
from afdserve.model.router import Router


def _moe_prefix(cfg: ModelConfig, layer: int, reader: CheckpointReader | None = None) -> str:
    """``model.layers.N.block_sparse_moe`` (Mixtral's classic layout) or ``model.layers.N.mlp``."""
    classic = f"model.layers.{layer}.block_sparse_moe"
    if cfg.family == "mixtral" and (reader is None or f"{classic}.gate.weight" in reader):
        return classic
    return f"model.layers.{layer}.mlp"


class AttentionModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.attn = nn.ModuleList((MLAPart(cfg, dtype) if cfg.mla is not None
                                   else AttentionPart(cfg, dtype, cfg.window(l)))
                                  for l in range(cfg.num_layers))
        # keyed by str(layer): routers and shared experts of the MoE layers, MLPs of the dense ones
        self.routers = nn.ModuleDict({str(l): Router(cfg, dtype) for l in cfg.moe_layers})
        self.shared = nn.ModuleDict({str(l): _shared_expert(cfg, dtype) for l in cfg.moe_layers}) \
            if cfg.has_shared_expert else None
        self.mlps = nn.ModuleDict({str(l): DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size, dtype)
                                   for l in cfg.dense_layers})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        # the distinct key windows of the layers (0: all keys): what a step's context prepares
        self.windows = tuple(sorted({getattr(a, "window", 0) for a in self.attn}))
        self.rotary = Rope.from_config({"rope_theta": cfg.rope_theta, **cfg.extra}, cfg.head_dim,
                                       cfg.max_position_embeddings)
        self.backends: Backends | None = None
        self._decode_half = _half  # compile_decode: the attention half of decode steps, compiled
        self.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def prepare(self, backends: Backends) -> "AttentionModel":
        """Packs the weights (on their device already) for ``backends`` and binds every layer to
        them: the attention half computes a plain router's logits along."""
        for child in self.children():
            prepare_all(child, backends)
        for layer, part in enumerate(self.attn):
            if isinstance(part, MLAPart):
                part.bind(backends)
                continue
            router = self.routers[str(layer)] if self.cfg.is_moe(layer) else None
            part.bind(backends, router.op if router is not None and router.plain_logits else None)
        self.backends = backends
        self._ring_attention = RingAttention.on(self.device)  # context-parallel steps' partial attentions
        return self

    def context(self, layout: StepLayout, buffers: StepBuffers) -> AttnContext:
        """The step's context every layer reads (the attention backend's, with the rotary tables)."""
        ctx = self.backends.attention.prepare(layout, self.windows, buffers)
        ctx.cos, ctx.sin = self.rotary.cos_sin(ctx.positions, self.dtype, int(layout.kv_lens.max(initial=0)))
        return ctx

    def cp_context(self, layout: StepLayout, buffers: StepBuffers, ring: Ring, owner: bool,
                   rank_slots: dict[int, np.ndarray], pieces: tuple | None = None, rank: int = 0,
                   keep: bool = False) -> CPContext:
        """A context-parallel prefill step's context (``afdserve.engine.cp``): its positions, the
        owner's cache slots (its own and, by rank, the other ranks'), the rotary tables and the ring."""
        stage = buffers.stage
        ctx = CPContext(layout, stage("positions", layout.positions), stage("slot_mapping", layout.slot_mapping),
                        layout.num_tokens, False, first_rows=stage("first_rows", layout.first_rows), ring=ring,
                        owner=owner, rank_slots={r: stage(f"cp_slots{r}", s) for r, s in rank_slots.items()},
                        attention=self._ring_attention, pieces=pieces, rank=rank, keep=keep)
        ctx.cos, ctx.sin = self.rotary.cos_sin(ctx.positions, self.dtype, int(layout.kv_lens.max(initial=0)))
        return ctx

    def sharded_context(self, layout: StepLayout, buffers: StepBuffers, peers: ShardPeers, own_slots: np.ndarray,
                        own_positions: np.ndarray) -> ShardedContext:
        """A decode step's context over sharded KV (``afdserve.engine.cp``): its new token's position
        and slot, this rank's keys (slots, positions), the rotary tables and the peers."""
        stage = buffers.stage
        ctx = ShardedContext(layout, stage("positions", layout.positions), stage("slot_mapping", layout.slot_mapping),
                             layout.num_tokens, True, first_rows=stage("first_rows", layout.first_rows), peers=peers,
                             own_slots=stage("own_slots", own_slots), own_positions=stage("own_positions", own_positions),
                             attention=self._ring_attention)
        ctx.cos, ctx.sin = self.rotary.cos_sin(ctx.positions, self.dtype, int(layout.kv_lens.max(initial=0)))
        return ctx

    @torch.inference_mode()
    def shard_partial(self, layer: int, kv: KVCache, q: torch.Tensor, q_pos: torch.Tensor, slots: torch.Tensor,
                      k_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A helper's part of a sharded decode step (``afdserve.backends.pytorch.cp_decode``): the
        attention of ``layer``'s queries q at ``q_pos`` over the keys it holds at ``slots``
        (positions ``k_pos``): (o, lse) float32."""
        part = self.attn[layer]
        caches = [kv.latent(layer)] if isinstance(part, MLAPart) else [kv.keys(layer), kv.values(layer)]
        dev = self.device
        return shard_partial(part, caches, q.to(dev), q_pos.to(dev), slots.to(dev), k_pos.to(dev), self.dtype,
                             self._ring_attention)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)

    def pre_moe(self, layer: int, x: torch.Tensor, ctx: AttnContext,
                kv: KVCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Attention half of a layer: returns (h, y, topk_ids, topk_weights); ids and weights are
        None for a dense layer (``cfg.is_moe(layer)`` false: nothing to dispatch)."""
        part, logits = self.attn[layer], None
        if isinstance(ctx, CPContext):  # a context-parallel prefill step: attention around the ring
            if isinstance(part, MLAPart):
                h, y = cp_latent(part, layer, x, ctx, kv.latent(layer))
            else:
                h, y, logits = cp_attention(part, layer, x, ctx, kv.keys(layer), kv.values(layer))
        elif isinstance(ctx, ShardedContext):  # a decode step over sharded KV: the other shards' partials merged
            if isinstance(part, MLAPart):
                h, y = sharded_latent(part, layer, x, ctx, kv.latent(layer))
            else:
                h, y, logits = sharded_attention(part, layer, x, ctx, kv.keys(layer), kv.values(layer))
        elif isinstance(part, MLAPart):
            h, y = part(x, ctx, kv.latent(layer))
        elif ctx.is_decode:
            h, y, logits = self._decode_half(part.half, x, ctx, kv.keys(layer), kv.values(layer))
        else:
            h, y, logits = part(x, ctx, kv.keys(layer), kv.values(layer))
        if not self.cfg.is_moe(layer):
            return h, y, None, None
        router = self.routers[str(layer)]
        ids, w = router(y) if logits is None else router.route(logits)
        return h, y, ids, w

    def compile_decode(self) -> None:
        """Runs the attention half of decode steps through ``torch.compile`` (one graph, dynamic shapes: one
        compilation for every batch size, context length and layer, on the first decode step). A
        compilation that fails warns and the model stays eager. MLA layers stay eager."""
        compiled = torch.compile(_half, dynamic=True, fullgraph=True)

        def run(half, x, ctx, k_cache, v_cache):
            try:
                # no duck sizing: the block tables' width would be guarded equal to any size it
                # matches once (the KV heads, say), and recompiled when it grows past it
                with torch.fx.experimental._config.patch(use_duck_shape=False):
                    return compiled(half, x, ctx, k_cache, v_cache)
            except Exception as e:  # a compiler missing or failing: eager from now on
                warnings.warn(f"torch.compile of the decode step failed, running eager: {type(e).__name__}: {e}",
                              RuntimeWarning, stacklevel=2)
                self._decode_half = _half
                return _half(half, x, ctx, k_cache, v_cache)

        self._decode_half = run

    def post_moe(self, layer: int, h: torch.Tensor, y: torch.Tensor, routed: torch.Tensor | None) -> torch.Tensor:
        """Combines the routed experts' output (and the shared expert) into the layer output; a
        dense layer (``routed`` None) runs its MLP here."""
        if not self.cfg.is_moe(layer):
            return h + self.mlps[str(layer)](y)
        if self.shared is not None:
            routed = routed + self.shared[str(layer)](y)
        return h + routed

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits [len(x), vocab] of the last hidden states ``x``."""
        return self.lm_head.op.logits(self.norm(x))

    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of ``logits(x)`` (int64), without keeping the logits where the backend can."""
        return self.lm_head.op.argmax(self.norm(x))

    @classmethod
    def load(cls, path: str | Path, dtype: str | torch.dtype = "float32",
             cfg: ModelConfig | None = None, reader: CheckpointReader | None = None) -> "AttentionModel":
        cfg = cfg or ModelConfig.from_pretrained(path)
        dt = parse_dtype(dtype)
        r = reader or CheckpointReader(path)
        m = cls(cfg, dt)
        h, nh, nkv, hd, v = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
        m.embed.weight.copy_(r.get("model.embed_tokens.weight", (v, h), dt))
        m.norm.weight.copy_(r.get("model.norm.weight", (h,), dt))
        if "lm_head.weight" in r or not cfg.tie_word_embeddings:
            m.lm_head.weight.copy_(read_lm_head(r, cfg, dt))
        else:
            m.lm_head.weight = m.embed.weight
        for l in range(cfg.num_layers):
            p, a = f"model.layers.{l}.", m.attn[l]
            if cfg.mla is not None:  # DeepSeek: MLA attention (with its norms), then the MLP side
                a.load(r, p, dt)
                _load_ffn(m, r, l, dt)
                continue
            q = r.get(p + "self_attn.q_proj.weight", (nh * hd, h), dt)
            k = r.get(p + "self_attn.k_proj.weight", (nkv * hd, h), dt)
            vv = r.get(p + "self_attn.v_proj.weight", (nkv * hd, h), dt)
            a.qkv.weight.copy_(torch.cat([q, k, vv]))
            if cfg.qkv_bias:
                a.qkv.bias.copy_(torch.cat([
                    r.get(p + "self_attn.q_proj.bias", (nh * hd,), dt),
                    r.get(p + "self_attn.k_proj.bias", (nkv * hd,), dt),
                    r.get(p + "self_attn.v_proj.bias", (nkv * hd,), dt),
                ]))
            a.o_proj.weight.copy_(r.get(p + "self_attn.o_proj.weight", (h, nh * hd), dt))
            gpt_oss_weights.load_attention_extras(a, r, p, dt)  # o_proj bias, sinks (if the model has them)
            a.input_norm.weight.copy_(r.get(p + "input_layernorm.weight", (h,), dt))
            a.post_norm.weight.copy_(r.get(p + "post_attention_layernorm.weight", (h,), dt))
            if cfg.qk_norm:
                a.q_norm.weight.copy_(r.get(p + "self_attn.q_norm.weight", (hd,), dt))
                a.k_norm.weight.copy_(r.get(p + "self_attn.k_norm.weight", (hd,), dt))
            _load_ffn(m, r, l, dt)
        return m


def _half(half, x: torch.Tensor, ctx: AttnContext, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
    """A layer's bound attention half (``AttentionPart.half``): what ``compile_decode`` compiles."""
    return half(x, ctx, k_cache, v_cache)


def _shared_expert(cfg: ModelConfig, dtype: torch.dtype) -> nn.Module:
    """Qwen2-MoE's gated shared expert, or DeepSeek's ungated shared experts (one wide MLP)."""
    if cfg.shared_expert_gated:
        return SharedExpert(cfg, dtype)
    return DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype)


def _load_ffn(m: AttentionModel, r: CheckpointReader, layer: int, dt: torch.dtype) -> None:
    """The attention side's part of a layer's MLP: a dense layer's MLP, or a MoE layer's router and
    shared expert."""
    cfg, key = m.cfg, str(layer)
    moe = _moe_prefix(cfg, layer, r)
    if not cfg.is_moe(layer):
        m.mlps[key].load(r, moe, dt)
        return
    m.routers[key] = load_router(r, cfg, layer, dt)
    if m.shared is None:
        return
    s = m.shared[key]
    if isinstance(s, DenseMLP):
        s.load(r, moe + ".shared_experts", dt)
        return
    h, i = cfg.hidden_size, cfg.shared_expert_intermediate_size
    s.w_gate_up.copy_(torch.cat([
        r.get(moe + ".shared_expert.gate_proj.weight", (i, h), dt),
        r.get(moe + ".shared_expert.up_proj.weight", (i, h), dt),
    ]))
    s.w_down.copy_(r.get(moe + ".shared_expert.down_proj.weight", (h, i), dt))
    s.gate.copy_(r.get(moe + ".shared_expert_gate.weight", (1, h), dt))


class ExpertModel(nn.Module):
    """The routed experts ``expert_ids[layer]`` of every layer (logical ids)."""

    def __init__(self, cfg: ModelConfig, expert_ids: Sequence[Sequence[int]], dtype: torch.dtype):
        super().__init__()
        if len(expert_ids) != cfg.num_layers:
            raise ModelError(f"expert_ids has {len(expert_ids)} layers, model has {cfg.num_layers}")
        self.cfg, self.dtype = cfg, dtype
        # a dense layer holds no experts whatever the map says: its MLP is on the attention side
        self.layers = nn.ModuleList(ExpertPart(cfg, ids if cfg.is_moe(l) else [], dtype)
                                    for l, ids in enumerate(expert_ids))
        self.backends: Backends | None = None
        self.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.layers[0].local_index.device

    def prepare(self, backends: Backends) -> "ExpertModel":
        """Packs every layer's held experts (on their device already) for ``backends``."""
        prepare_all(self.layers, backends)
        self.backends = backends
        return self

    @classmethod
    def load(cls, path: str | Path, expert_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
             dtype: str | torch.dtype = "float32", cfg: ModelConfig | None = None,
             reader: CheckpointReader | None = None) -> "ExpertModel":
        """Loads experts ``expert_ids`` (the same for every layer, or a list per layer; None = all)."""
        cfg = cfg or ModelConfig.from_pretrained(path)
        dt = parse_dtype(dtype)
        if expert_ids is None:
            expert_ids = list(range(cfg.num_experts))
        per_layer = [list(x) for x in expert_ids] if expert_ids and isinstance(expert_ids[0], (list, tuple)) \
            else [list(expert_ids)] * cfg.num_layers
        for ids in per_layer:
            bad = [e for e in ids if not 0 <= e < cfg.num_experts]
            if bad:
                raise ModelError(f"expert ids {bad} out of range 0..{cfg.num_experts - 1}")
        r = reader or CheckpointReader(path)
        m = cls(cfg, per_layer, dt)
        for l, part in enumerate(m.layers):
            for j, e in enumerate(part.expert_ids):
                part.set_weights(j, read_expert(r, cfg, l, e, dt))
        return m


def regroup_experts(old: ExpertModel, expert_ids: Sequence[Sequence[int]], reader: CheckpointReader) -> ExpertModel:
    """An ExpertModel holding ``expert_ids[layer]`` on ``old``'s device, prepared for its backends (if
    it was): weights it already has are copied from ``old``, the others are read from the checkpoint."""
    new = ExpertModel(old.cfg, [list(x) for x in expert_ids], old.dtype)
    for layer, (part, before) in enumerate(zip(new.layers, old.layers)):
        have = {e: j for j, e in enumerate(before.expert_ids)}
        for j, e in enumerate(part.expert_ids):
            if e in have:
                part.set_weights(j, before.weights(have[e]))
            else:
                part.set_weights(j, read_expert(reader, old.cfg, layer, e, old.dtype))
    new = new.to(old.device)
    return new if old.backends is None else new.prepare(old.backends)


def read_lm_head(r: CheckpointReader, cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    """The LM head [vocab, hidden] (the embeddings when the model ties them)."""
    shape = (cfg.vocab_size, cfg.hidden_size)
    if "lm_head.weight" in r:
        return r.get("lm_head.weight", shape, dtype)
    if cfg.tie_word_embeddings:
        return r.get("model.embed_tokens.weight", shape, dtype)
    raise ModelError(f"{r.path}: missing tensor 'lm_head.weight'")


def read_router(r: CheckpointReader, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> torch.Tensor:
    """The router (gate) weight [E, H] of ``layer``: the one place router weights are read."""
    gate = ".router" if cfg.family == "gpt_oss" else ".gate"
    return r.get(_moe_prefix(cfg, layer, r) + gate + ".weight", (cfg.num_experts, cfg.hidden_size), dtype)


def load_router(r: CheckpointReader, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> Router:
    """The router of MoE layer ``layer`` (with DeepSeek-V3's ``e_score_correction_bias``)."""
    router = Router(cfg, dtype)
    router.weight.copy_(read_router(r, cfg, layer, dtype))
    if router.bias is not None:
        name = _moe_prefix(cfg, layer, r) + ".gate.e_score_correction_bias"
        router.bias.copy_(r.get(name, (cfg.num_experts,), torch.float32))
    if router.logit_bias is not None:  # gpt-oss
        router.logit_bias.copy_(r.get(_moe_prefix(cfg, layer, r) + ".router.bias", (cfg.num_experts,), dtype))
    return router


def load_routers(r: CheckpointReader, cfg: ModelConfig, dtype: torch.dtype) -> dict[int, Router]:
    """The router of every MoE layer, for a worker that routes without holding the attention half
    (JANUS's expert-side gate)."""
    return {layer: load_router(r, cfg, layer, dtype) for layer in cfg.moe_layers}


def read_expert(r: CheckpointReader, cfg: ModelConfig, layer: int, expert: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Reads one routed expert's ([2I, H] gate+up, [H, I] down) in any supported layout (and its
    biases, for gpt-oss: ``ExpertPart.weights``)."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    moe = _moe_prefix(cfg, layer, r)
    if cfg.family == "gpt_oss":
        return gpt_oss_weights.read_expert(r, cfg, moe, expert, dtype)
    p = f"{moe}.experts.{expert}."
    if cfg.family == "mixtral" and p + "w1.weight" in r:
        gate, up, down = p + "w1.weight", p + "w3.weight", p + "w2.weight"
    elif p + "gate_proj.weight" in r:
        gate, up, down = p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"
    elif f"{moe}.experts.gate_up_proj" in r:  # fused layout (transformers >= 5 in-memory naming)
        return (r.get_rows(f"{moe}.experts.gate_up_proj", expert, (2 * i, h), dtype),
                r.get_rows(f"{moe}.experts.down_proj", expert, (h, i), dtype))
    else:
        raise ModelError(f"{r.path}: missing tensors of expert {expert} in layer {layer} (looked for {p}*)")
    return (torch.cat([r.get(gate, (i, h), dtype), r.get(up, (i, h), dtype)]), r.get(down, (h, i), dtype))
