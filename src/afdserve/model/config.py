"""Model configuration parsed from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afdserve.errors import ModelError

# HF architecture name -> our family name
ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def _context_len(raw: dict[str, Any]) -> int:
    """Longest context we serve: sliding-window attention is not implemented, so a model with a
    window is served up to the window (where full attention and the window agree)."""
    n = int(raw.get("max_position_embeddings", 4096))
    window = raw.get("sliding_window")
    if window and (raw.get("use_sliding_window", True)):
        n = min(n, int(window))
    return n


@dataclass(frozen=True)
class ModelConfig:
    """The shapes and options of a supported MoE model (all layers are MoE layers)."""

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
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

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
            family = {"mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe"}.get(
                raw.get("model_type", "")
            )
        if family is None:
            raise ModelError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )

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
        else:
            sparse_step = int(raw.get("decoder_sparse_step", 1) or 1)
            mlp_only = raw.get("mlp_only_layers") or []
            if sparse_step != 1 or mlp_only:
                raise ModelError(
                    f"{source}: dense layers (decoder_sparse_step={sparse_step}, "
                    f"mlp_only_layers={mlp_only}) are not supported; every layer must be MoE"
                )
            cfg = cls(
                moe_intermediate_size=int(need("moe_intermediate_size")),
                num_experts=int(raw.get("num_experts") or need("num_local_experts")),
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
        }
        for name, ok in checks.items():
            if not ok:
                raise ModelError(f"{source}: invalid value for {name!r}")
