"""Model specs from a preset name or a Hugging Face ``config.json``.

The config is parsed by the model package's parser, :class:`afdserve.model.config.ModelConfig` (the
one the runtime serves models with); :func:`from_model_config` takes its shapes and reads from the
raw config only the weights' bytes per parameter. Dense layers, shared experts and DeepSeek's latent
attention (MLA) are as the runtime reads them, so the KV bytes per token are the allocator's.

A family the runtime does not serve (DBRX, other configs with the common key names) is handed to the same parser in the key layout of a plain Mixtral-style
MoE (:func:`_as_plain_moe`: DBRX's names renamed, the routed experts' width and count under
Mixtral's keys).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from afdserve.errors import ModelError
from afdserve.model.config import ARCHITECTURES, ModelConfig
from afdserve.planner.presets import PRESETS, preset
from afdserve.planner.spec import MLAConfig, ModelSpec

__all__ = ["from_model_config", "from_hf_config", "load_model_spec"]


def _dtype_bytes(raw: Mapping[str, Any]) -> float:
    quant = raw.get("quantization_config") or {}
    fmt = str(quant.get("fmt", "") or quant.get("quant_method", "")).lower()
    if "fp8" in fmt or "e4m3" in fmt:
        return 1.0
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16").lower()
    return {"float32": 4.0, "float": 4.0, "float16": 2.0, "half": 2.0, "bfloat16": 2.0}.get(dtype, 2.0)


def _served(raw: Mapping[str, Any]) -> bool:
    """Whether ``ModelConfig`` reads ``raw`` as it is: a family the runtime serves."""
    archs = raw.get("architectures") or []
    return any(a in ARCHITECTURES for a in archs) or raw.get("model_type") in ARCHITECTURES.values()


def _first(raw: Mapping[str, Any], *keys: str) -> Any:
    return next((raw[k] for k in keys if raw.get(k) is not None), None)


def _as_plain_moe(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` in the key layout ``ModelConfig`` reads for a Mixtral-style MoE."""
    keys: dict[str, Any] = {}
    if str(raw.get("model_type", "")).lower() == "dbrx":
        attn, ffn = raw.get("attn_config") or {}, raw.get("ffn_config") or {}
        keys = {"hidden_size": raw.get("d_model"), "num_attention_heads": raw.get("n_heads"),
                "num_key_value_heads": attn.get("kv_n_heads"), "num_hidden_layers": raw.get("n_layers"),
                "max_position_embeddings": raw.get("max_seq_len"), "intermediate_size": ffn.get("ffn_hidden_size"),
                "num_local_experts": ffn.get("moe_num_experts"), "num_experts_per_tok": ffn.get("moe_top_k")}
    else:
        keys = {"intermediate_size": _first(raw, "moe_intermediate_size", "intermediate_size", "ffn_hidden_size"),
                "num_local_experts": _first(raw, "num_local_experts", "num_experts", "n_routed_experts"),
                "num_experts_per_tok": _first(raw, "num_experts_per_tok", "moe_top_k")}
    present = {k: v for k, v in keys.items() if v is not None}
    return {**raw, **present, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}


def from_model_config(cfg: ModelConfig, raw: Mapping[str, Any] | None = None, name: str | None = None,
                      source: str = "config.json") -> ModelSpec:
    """The planner's view of a model: its shapes as ``ModelConfig`` parsed them -- dense layers
    (Qwen-MoE ``mlp_only_layers`` / ``decoder_sparse_step``, DeepSeek's first layers), shared
    experts, DeepSeek's latent attention, whose KV bytes are those the runtime's allocator holds --
    and from ``raw`` (default: the config ``cfg`` was read from) the bytes per parameter."""
    raw = cfg.extra if raw is None else raw
    mla = None
    if cfg.mla is not None:
        a = cfg.mla
        mla = MLAConfig(kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
                        qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim, q_lora_rank=a.q_lora_rank)
    shared = cfg.shared_expert_intermediate_size or int(raw.get("shared_expert_intermediate_size") or 0)
    n_shared = int(raw.get("n_shared_experts") or 0) if cfg.mla is not None else 1
    return ModelSpec(
        name=name or str(raw.get("_name_or_path") or raw.get("model_type") or "model"),
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, intermediate_size=cfg.moe_intermediate_size,
        num_experts=cfg.num_experts, top_k=cfg.top_k, num_attention_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.mla.v_head_dim if cfg.mla is not None else cfg.head_dim,  # MLA: the per-head value width
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, bytes_per_param=_dtype_bytes(raw), source=source,
        num_shared_experts=n_shared if shared else 0, shared_intermediate_size=shared,
        num_dense_layers=len(cfg.dense_layers), dense_intermediate_size=cfg.dense_intermediate_size, mla=mla)


def from_hf_config(raw: Mapping[str, Any], name: str | None = None, source: str = "config.json") -> ModelSpec:
    """A :class:`ModelSpec` from a parsed Hugging Face ``config.json``: Mixtral, Qwen2-MoE and
    Qwen3-MoE (as the runtime reads them), DBRX, DeepSeek-V2/V3, and other MoE configs with the
    common key names (``num_local_experts``/``num_experts``/``n_routed_experts``). A quantized
    checkpoint (which the runtime refuses) is planned with its shapes and its weights' bytes."""
    shapes = {k: v for k, v in raw.items() if k != "quantization_config"}
    cfg = ModelConfig.from_dict(shapes if _served(raw) else _as_plain_moe(shapes), source=source)
    return from_model_config(cfg, raw, name, source)


def load_model_spec(name_or_path: str) -> ModelSpec:
    """A preset by name (case-insensitive, a few aliases), or a ``config.json`` file or folder."""
    spec = preset(name_or_path)
    if spec is not None:
        return spec
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelError(f"{path}: invalid JSON: {e}") from e
        stem = path.parent.name if path.name == "config.json" else path.stem
        return from_hf_config(raw, name=stem or None, source=str(path))
    raise ModelError(f"unknown model {name_or_path!r}: not a preset ({', '.join(PRESETS)}) nor a config.json path")
