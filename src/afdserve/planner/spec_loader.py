"""Model specs from a preset name or a Hugging Face ``config.json``.

The config is parsed by the model package's parser, :class:`afdserve.model.config.ModelConfig` (the
one the runtime serves models with); :func:`from_model_config` takes its shapes and reads from the
raw config only what the performance model needs beyond them: the weights' bytes per parameter,
dense layers, shared experts and latent attention (MLA).

A family the runtime does not serve (DBRX, DeepSeek-V2/V3, MoEs with dense layers, other configs
with the common key names) is handed to the same parser in the key layout of a plain Mixtral-style
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
    """Whether ``ModelConfig`` reads ``raw`` as it is: a family the runtime serves, every layer MoE."""
    archs = raw.get("architectures") or []
    family = any(a in ARCHITECTURES for a in archs) or raw.get("model_type") in ARCHITECTURES.values()
    dense = int(raw.get("decoder_sparse_step", 1) or 1) != 1 or bool(raw.get("mlp_only_layers"))
    return family and not dense


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


def _mla(raw: Mapping[str, Any], source: str) -> MLAConfig:
    def need(key: str) -> int:
        if raw.get(key) is None:
            raise ModelError(f"{source}: missing field {key!r} required for multi-head latent attention")
        return int(raw[key])

    q_lora = raw.get("q_lora_rank")
    return MLAConfig(kv_lora_rank=need("kv_lora_rank"), qk_nope_head_dim=need("qk_nope_head_dim"),
                     qk_rope_head_dim=need("qk_rope_head_dim"), v_head_dim=need("v_head_dim"),
                     q_lora_rank=int(q_lora) if q_lora else None)


def from_model_config(cfg: ModelConfig, raw: Mapping[str, Any] | None = None, name: str | None = None,
                      source: str = "config.json") -> ModelSpec:
    """The planner's view of a model: its shapes from ``cfg``; from ``raw`` (default: the config
    ``cfg`` was read from) the bytes per parameter and what ``ModelConfig`` does not describe --
    dense layers (Qwen-MoE ``mlp_only_layers`` / ``decoder_sparse_step``, DeepSeek's first layers),
    shared experts and DeepSeek's latent attention."""
    raw = cfg.extra if raw is None else raw
    mtype = str(raw.get("model_type", "")).lower()
    common: dict[str, Any] = dict(
        name=name or str(raw.get("_name_or_path") or mtype or "model"),
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.moe_intermediate_size,
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        num_attention_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bytes_per_param=_dtype_bytes(raw),
        source=source,
    )
    if mtype.startswith("deepseek"):
        mla = _mla(raw, source)
        n_shared = int(raw.get("n_shared_experts") or 0)
        common["head_dim"] = mla.v_head_dim  # unused by MLA formulas; the per-head value width
        return ModelSpec(num_shared_experts=n_shared, shared_intermediate_size=n_shared * cfg.moe_intermediate_size,
                         num_dense_layers=int(raw.get("first_k_dense_replace") or 0),
                         dense_intermediate_size=int(raw.get("intermediate_size") or 0), mla=mla, **common)
    shared = cfg.shared_expert_intermediate_size or int(raw.get("shared_expert_intermediate_size") or 0)
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    n_dense = len(raw.get("mlp_only_layers") or []) + (cfg.num_layers - cfg.num_layers // step if step > 1 else 0)
    return ModelSpec(num_shared_experts=1 if shared else 0, shared_intermediate_size=shared, num_dense_layers=n_dense,
                     dense_intermediate_size=int(raw.get("intermediate_size") or 0) if n_dense else 0, **common)


def from_hf_config(raw: Mapping[str, Any], name: str | None = None, source: str = "config.json") -> ModelSpec:
    """A :class:`ModelSpec` from a parsed Hugging Face ``config.json``: Mixtral, Qwen2-MoE and
    Qwen3-MoE (as the runtime reads them), DBRX, DeepSeek-V2/V3, and other MoE configs with the
    common key names (``num_local_experts``/``num_experts``/``n_routed_experts``)."""
    cfg = ModelConfig.from_dict(dict(raw) if _served(raw) else _as_plain_moe(raw), source=source)
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
