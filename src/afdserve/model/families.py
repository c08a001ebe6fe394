"""The family-specific parts of a ``ModelConfig``: which layers have experts (dense layers run on the
attention side), DeepSeek's multi-head latent attention (MLA) shapes and its routing options."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from afdserve.errors import ModelError
from afdserve.model.rope import rope_parameters

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention. The paged cache holds per token and layer the
    compressed latent (``kv_lora_rank``, after ``kv_a_layernorm``) and the decoupled RoPE key
    (``qk_rope_head_dim``): ``latent_dim`` values."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None  # None: a plain q_proj
    rope_interleave: bool  # pairs (x0, x1), (x2, x3)... rotate together (V2 always; V3 by default)
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2
    attention_bias: bool = False

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _mla_softmax_scale(raw: dict[str, Any], qk_head_dim: int) -> float:
    """transformers' ``yarn_apply_mscale``: a scaled RoPE with ``mscale_all_dim`` multiplies the
    softmax scale by ``(0.1 * mscale_all_dim * ln(factor) + 1) ** 2`` (when factor > 1)."""
    scale = qk_head_dim**-0.5
    p = rope_parameters(raw)
    m_all = p.get("mscale_all_dim") or 0
    if p["rope_type"] != "default" and m_all:
        factor = float(p.get("factor") or 1.0)
        m = 1.0 if factor <= 1 else 0.1 * float(m_all) * math.log(factor) + 1.0
        scale *= m * m
    return scale


def deepseek_fields(family: str, raw: dict[str, Any], need: Callable[[str], Any], source: str) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a DeepSeek-V2/V3 config (all but the common ones)."""
    if raw.get("mlp_bias"):
        raise ModelError(f"{source}: mlp_bias=true (biases in the dense MLPs) is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelError(f"{source}: hidden_act={raw.get('hidden_act')!r} is not supported (silu only)")
    nope, rope = int(need("qk_nope_head_dim")), int(need("qk_rope_head_dim"))
    q_lora = raw.get("q_lora_rank")
    mla = MLAConfig(
        kv_lora_rank=int(need("kv_lora_rank")), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
        v_head_dim=int(need("v_head_dim")), q_lora_rank=int(q_lora) if q_lora else None,
        rope_interleave=True if family == "deepseek_v2" else bool(raw.get("rope_interleave", True)),
        softmax_scale=_mla_softmax_scale(raw, nope + rope), attention_bias=bool(raw.get("attention_bias", False)),
    )
    for name, v in (("kv_lora_rank", mla.kv_lora_rank), ("v_head_dim", mla.v_head_dim), ("qk_nope_head_dim", nope)):
        if v <= 0:
            raise ModelError(f"{source}: invalid value for {name!r}")
    if rope <= 0 or rope % 2:
        raise ModelError(f"{source}: invalid value for 'qk_rope_head_dim' (a positive even number)")
    n_experts, layers = int(need("n_routed_experts")), int(need("num_hidden_layers"))
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    moe_inter = int(need("moe_intermediate_size"))
    if family == "deepseek_v2":
        # transformers' DeepseekV2TopkRouter: softmax, greedy or group-limited top-k, never renormalized
        method, scoring, norm = str(raw.get("topk_method") or "greedy"), "softmax", False
        if method not in ("greedy", "group_limited_greedy"):
            raise ModelError(f"{source}: unsupported topk_method {method!r} for DeepSeek-V2; "
                             f"supported: greedy, group_limited_greedy")
    else:  # DeepseekV3TopkRouter: sigmoid + correction bias, group-limited top-k, whatever topk_method says
        method, scoring, norm = "noaux_tc", "sigmoid", bool(raw.get("norm_topk_prob", True))
    n_group = int(raw.get("n_group") or 1)
    topk_group = int(raw.get("topk_group") or n_group)
    if method != "greedy":
        if n_group < 1 or n_experts % n_group:
            raise ModelError(f"{source}: n_group={n_group} must divide n_routed_experts={n_experts}")
        if not 0 < topk_group <= n_group:
            raise ModelError(f"{source}: topk_group={topk_group} must be in 1..n_group={n_group}")
        if int(need("num_experts_per_tok")) > topk_group * (n_experts // n_group):
            raise ModelError(f"{source}: num_experts_per_tok exceeds the experts of topk_group={topk_group} groups")
    n_shared = int(raw.get("n_shared_experts") or 0)
    return dict(
        moe_intermediate_size=moe_inter, num_experts=n_experts, top_k=int(need("num_experts_per_tok")),
        norm_topk_prob=norm, shared_expert_intermediate_size=n_shared * moe_inter, shared_expert_gated=False,
        dense_layers=tuple(range(min(first_dense, layers))),
        dense_intermediate_size=int(need("intermediate_size")) if first_dense > 0 else 0,
        mla=mla, scoring=scoring, topk_method=method, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        # MLA's heads all share one latent; the config's num_key_value_heads has no meaning here
        num_kv_heads=int(need("num_attention_heads")), head_dim=rope,
    )


def qwen_dense_layers(raw: dict[str, Any], num_layers: int, num_experts: int) -> tuple[int, ...]:
    """transformers' rule for Qwen2-MoE / Qwen3-MoE: layer l is sparse iff l is not in
    ``mlp_only_layers``, ``num_experts > 0`` and ``(l + 1) % decoder_sparse_step == 0``."""
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    only = {int(x) for x in (raw.get("mlp_only_layers") or [])}
    return tuple(l for l in range(num_layers)
                 if l in only or not (num_experts > 0 and (l + 1) % step == 0))
