"""Model configuration parsed from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afdserve.errors import ModelError
from afdserve.model.families import MLAConfig, deepseek_fields, qwen_dense_layers
from afdserve.model.gpt_oss import check_not_quantized, gpt_oss_fields, layer_windows
from afdserve.model.rope import served_context

# HF architecture name -> our family name
ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GptOssForCausalLM": "gpt_oss",
}


def _context_len(raw: dict[str, Any]) -> int:
    """Longest context we serve (a sliding-window model too: its windowed layers attend to the window)."""
    return served_context(raw)


@dataclass(frozen=True)
class ModelConfig:
    """The shapes and options of a supported MoE model (``dense_layers`` have no experts)."""

    family: str
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    qkv_bias: bool = False
    qk_norm: bool = False
    shared_expert_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # -- layers without experts, MLA and DeepSeek's routing (model/families.py) --
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP (no experts): it runs on the attention side
    dense_intermediate_size: int = 0
    shared_expert_gated: bool = True  # Qwen2-MoE's sigmoid gate on the shared expert; DeepSeek has none
    mla: MLAConfig | None = None  # DeepSeek's multi-head latent attention (None: GQA)
    scoring: str = "softmax"  # router scores: "softmax" or "sigmoid" (+ e_score_correction_bias)
    topk_method: str = "greedy"  # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # -- sliding windows (every family) and gpt-oss (model/gpt_oss.py) --
    sliding_windows: tuple[int, ...] = ()  # per layer: keys attended (0: full attention); (): none
    attention_sinks: bool = False  # a learned per-head logit in every softmax (gpt-oss)
    o_proj_bias: bool = False
    router_bias: bool = False
    expert_bias: bool = False  # biases of the routed experts' projections
    expert_activation: str = "silu"  # "silu" (SwiGLU) or "swiglu_oai" (gpt-oss's clamped SwiGLU)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def window(self, layer: int) -> int:
        """Keys ``layer`` attends to (0: all)."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    @property
    def kv_window(self) -> int:
        """Keys every layer keeps within (0: some layer attends to all): KV blocks that fall out of
        this window are never read again."""
        return max(self.sliding_windows) if self.sliding_windows and all(self.sliding_windows) else 0

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    def is_moe(self, layer: int) -> bool:
        """Whether ``layer`` has routed experts (else its dense MLP runs on the attention side)."""
        return layer not in self.dense_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(l for l in range(self.num_layers) if l not in self.dense_layers)

    @property
    def kv_latent_dim(self) -> int:
        """Values cached per token and layer in MLA's latent layout (0: the K/V layout)."""
        return self.mla.latent_dim if self.mla is not None else 0

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelError(f"{path}: no config.json (expected a Hugging Face model folder)")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelError(f"{cfg_file}: invalid JSON: {e}") from e
        return cls.from_dict(raw, source=str(cfg_file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> "ModelConfig":
        archs = raw.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            family = {f: f for f in ARCHITECTURES.values()}.get(raw.get("model_type", ""))
        if family is None:
            raise ModelError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )

        check_not_quantized(raw, source)

        def need(key: str) -> Any:
            if key not in raw or raw[key] is None:
                raise ModelError(f"{source}: missing field {key!r} required for {family}")
            return raw[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        layers = int(need("num_hidden_layers"))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
        rope_theta = raw.get("rope_theta")
        if rope_theta is None:
            rope_theta = (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        common = dict(
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=_context_len(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            sliding_windows=layer_windows(family, raw, layers),
            extra=raw,
        )
        if family == "mixtral":
            cfg = cls(
                moe_intermediate_size=int(need("intermediate_size")),
                num_experts=int(need("num_local_experts")),
                top_k=int(need("num_experts_per_tok")),
                norm_topk_prob=True,
                **common,
            )
        elif family == "gpt_oss":
            cfg = cls(**(common | gpt_oss_fields(raw, need)))
        elif family in ("deepseek_v2", "deepseek_v3"):
            cfg = cls(**(common | deepseek_fields(family, raw, need, source)))
        else:
            n_experts = int(raw.get("num_experts") or need("num_local_experts"))
            dense = qwen_dense_layers(raw, layers, n_experts)
            cfg = cls(
                dense_layers=dense,
                dense_intermediate_size=int(need("intermediate_size")) if dense else 0,
                moe_intermediate_size=int(need("moe_intermediate_size")),
                num_experts=n_experts,
                top_k=int(need("num_experts_per_tok")),
                norm_topk_prob=bool(raw.get("norm_topk_prob", family == "qwen3_moe")),
                qkv_bias=bool(raw.get("qkv_bias", True))
                if family == "qwen2_moe"
                else bool(raw.get("attention_bias", False)),
                qk_norm=family == "qwen3_moe",
                shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0)
                if family == "qwen2_moe"
                else 0,
                **common,
            )
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config") -> None:
        checks = {
            "hidden_size": self.hidden_size > 0,
            "num_attention_heads": self.num_heads > 0,
            "num_key_value_heads": self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0,
            "num_hidden_layers": self.num_layers > 0,
            "vocab_size": self.vocab_size > 0,
            "num_experts": self.num_experts > 0,
            "num_experts_per_tok": 0 < self.top_k <= self.num_experts,
            "head_dim": self.head_dim > 0 and self.head_dim % 2 == 0,
            "intermediate_size": not self.dense_layers or self.dense_intermediate_size > 0,
            "num_hidden_layers (no layer has experts)": len(self.dense_layers) < self.num_layers,
        }
        for name, ok in checks.items():
            if not ok:
                raise ModelError(f"{source}: invalid value for {name!r}")
