"""Model specifications for the planner: the shapes that drive the performance model.

A :class:`ModelSpec` holds what Eqs. (1)-(8) of the MegaScale-Infer design need -- layers ``L``,
hidden size ``h``, expert intermediate size ``h'``, experts ``E``, top-k ``K``, GQA group size
``g`` -- plus what the memory model needs (shared experts, dense layers, embeddings, bytes per
parameter, latent KV for MLA models).

Specs come from a built-in preset (:data:`PRESETS`) or from a Hugging Face ``config.json``
(:func:`from_hf_config`, :func:`load_model_spec`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from afdserve.errors import ModelError

__all__ = ["MLAConfig", "ModelSpec", "PRESETS", "from_hf_config", "load_model_spec", "preset_names", "with_overrides"]


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds a compressed latent."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: queries are projected directly from h


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of an MoE transformer, as the planner sees them.

    ``intermediate_size`` is the width of one *routed* expert (``h'`` in the paper).  Layers listed
    in ``num_dense_layers`` (DeepSeek-V3's first three) have a dense FFN that the planner places on
    the attention side; for timing they are counted as MoE layers (an approximation, see
    docs/planner.md).
    """

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0  # total width of the shared expert(s)
    num_dense_layers: int = 0
    dense_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    bytes_per_param: float = 2.0  # weights (bf16 = 2, fp8 = 1)
    kv_bytes: float = 2.0  # per KV-cache element
    act_bytes: float = 2.0  # per activation element sent between attention and experts
    mla: MLAConfig | None = None
    source: str = ""

    def __post_init__(self) -> None:
        positive = {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
        }
        for key, value in positive.items():
            if value <= 0:
                raise ModelError(f"model spec {self.name!r}: {key} must be positive, got {value}")
        if self.top_k > self.num_experts:
            raise ModelError(f"model spec {self.name!r}: top_k {self.top_k} > experts {self.num_experts}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ModelError(f"model spec {self.name!r}: heads not divisible by kv heads")
        if not 0 <= self.num_dense_layers < self.num_layers:
            raise ModelError(f"model spec {self.name!r}: num_dense_layers out of range")

    # ----- derived shapes -------------------------------------------------------------------
    @property
    def gqa_group(self) -> float:
        """``g``: query heads per KV head."""
        return self.num_attention_heads / self.num_kv_heads

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def kv_elems_per_token_layer(self) -> int:
        """KV-cache elements one token occupies in one layer (K and V, or the MLA latent)."""
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token_layer(self) -> float:
        return self.kv_elems_per_token_layer * self.kv_bytes

    def kv_replication(self, tp: int) -> float:
        """How many copies of the KV cache a TP group of ``tp`` GPUs keeps in total.

        GQA splits KV heads across ranks; with fewer KV heads than ranks the heads are replicated.
        MLA's latent is shared by all heads, so every rank keeps a full copy.
        """
        if self.mla is not None:
            return float(tp)
        return max(1.0, tp / self.num_kv_heads)

    @property
    def attention_params_per_layer(self) -> int:
        h = self.hidden_size
        if self.mla is not None:
            a = self.mla
            nh = self.num_attention_heads
            qk = a.qk_nope_head_dim + a.qk_rope_head_dim
            q = h * nh * qk if a.q_lora_rank is None else h * a.q_lora_rank + a.q_lora_rank * nh * qk
            kv = h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * nh * (a.qk_nope_head_dim + a.v_head_dim)
            o = nh * a.v_head_dim * h
            return q + kv + o
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        return h * q_out + 2 * h * kv_out + q_out * h

    def attention_core_flops_per_ctx_token(self) -> float:
        """FLOPs one decoded token spends per cached token per layer (scores + weighted sum)."""
        nh = self.num_attention_heads
        if self.mla is not None:  # absorbed MLA: attends over the latent (+ rope part)
            a = self.mla
            return 2.0 * nh * (2 * a.kv_lora_rank + a.qk_rope_head_dim)
        return 4.0 * nh * self.head_dim

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert in one layer (gate, up, down)."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def router_params_per_layer(self) -> int:
        return self.hidden_size * self.num_experts

    @property
    def shared_params_per_layer(self) -> int:
        return 3 * self.hidden_size * self.shared_intermediate_size

    @property
    def dense_ffn_params_per_layer(self) -> int:
        return 3 * self.hidden_size * self.dense_intermediate_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def attention_side_params_per_layer(self) -> int:
        """Weights an attention node streams per MoE layer: attention, router, shared experts."""
        return self.attention_params_per_layer + self.router_params_per_layer + self.shared_params_per_layer

    @property
    def attention_side_params(self) -> int:
        """``P_a``: everything except the routed experts (all of it lives on attention nodes)."""
        h = self.hidden_size
        return (
            self.num_layers * (self.attention_params_per_layer + 2 * h)
            + self.num_moe_layers * (self.router_params_per_layer + self.shared_params_per_layer)
            + self.num_dense_layers * self.dense_ffn_params_per_layer
            + self.embedding_params
            + h
        )

    def expert_node_params(self, experts_per_node: int = 1) -> int:
        """``P_e`` (times ``experts_per_node``): routed-expert weights one expert node holds."""
        return experts_per_node * self.expert_params * self.num_moe_layers

    @property
    def total_params(self) -> int:
        return self.attention_side_params + self.num_experts * self.expert_params * self.num_moe_layers

    @property
    def attention_param_bytes(self) -> float:
        return self.attention_side_params * self.bytes_per_param

    def expert_node_param_bytes(self, experts_per_node: int = 1) -> float:
        return self.expert_node_params(experts_per_node) * self.bytes_per_param

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


# --------------------------------------------------------------------------------------------
# Presets.  Sources:
#   mixtral-8x22b, dbrx, scaled-moe: layers/hidden/experts/top-k/intermediate from Table 4 of the
#     MegaScale-Infer paper; attention shapes and vocab from the public HF configs
#     (mistralai/Mixtral-8x22B-v0.1, databricks/dbrx-base).  bf16 everywhere (paper §7.1).
#   scaled-moe: Table 4 gives only L=48, h=8192, E=32, K=4, h'=8192.  The paper says it "shares a
#     similar structure" with the others; we assume head_dim 128 (64 heads), 8 KV heads and a
#     32768 vocab, which brings the total to 317B -- the size the paper states.
#   deepseek-v3: HF deepseek-ai/DeepSeek-V3 config.json (MLA, 256 routed + 1 shared expert,
#     first 3 layers dense, fp8 weights as released).
#   qwen3-235b-a22b: HF Qwen/Qwen3-235B-A22B config.json.
#   demo: this repository's demo model (afdserve.model.demo.DEMO_CONFIG).
# --------------------------------------------------------------------------------------------
PRESETS: dict[str, ModelSpec] = {
    "mixtral-8x22b": ModelSpec(
        name="mixtral-8x22b",
        num_layers=56,
        hidden_size=6144,
        intermediate_size=16384,
        num_experts=8,
        top_k=2,
        num_attention_heads=48,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=32768,
        max_position_embeddings=65536,
        source="MegaScale-Infer Table 4 + HF mistralai/Mixtral-8x22B-v0.1",
    ),
    "dbrx": ModelSpec(
        name="dbrx",
        num_layers=40,
        hidden_size=6144,
        intermediate_size=10752,
        num_experts=16,
        top_k=4,
        num_attention_heads=48,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=100352,
        max_position_embeddings=32768,
        source="MegaScale-Infer Table 4 + HF databricks/dbrx-base",
    ),
    "scaled-moe": ModelSpec(
        name="scaled-moe",
        num_layers=48,
        hidden_size=8192,
        intermediate_size=8192,
        num_experts=32,
        top_k=4,
        num_attention_heads=64,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=32768,
        max_position_embeddings=32768,
        source="MegaScale-Infer Table 4 (attention shape and vocab assumed, see spec.py)",
    ),
    "deepseek-v3": ModelSpec(
        name="deepseek-v3",
        num_layers=61,
        hidden_size=7168,
        intermediate_size=2048,
        num_experts=256,
        top_k=8,
        num_attention_heads=128,
        num_kv_heads=128,
        head_dim=128,
        vocab_size=129280,
        max_position_embeddings=163840,
        num_shared_experts=1,
        shared_intermediate_size=2048,
        num_dense_layers=3,
        dense_intermediate_size=18432,
        bytes_per_param=1.0,
        mla=MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536),
        source="HF deepseek-ai/DeepSeek-V3 config.json (fp8 weights, bf16 KV cache)",
    ),
    "qwen3-235b-a22b": ModelSpec(
        name="qwen3-235b-a22b",
        num_layers=94,
        hidden_size=4096,
        intermediate_size=1536,
        num_experts=128,
        top_k=8,
        num_attention_heads=64,
        num_kv_heads=4,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        source="HF Qwen/Qwen3-235B-A22B config.json",
    ),
    "demo": ModelSpec(
        name="demo",
        num_layers=8,
        hidden_size=256,
        intermediate_size=1024,
        num_experts=8,
        top_k=2,
        num_attention_heads=8,
        num_kv_heads=2,
        head_dim=32,
        vocab_size=32000,
        max_position_embeddings=4096,
        source="afdserve demo model (Mixtral-style)",
    ),
}

_ALIASES = {
    "mixtral": "mixtral-8x22b",
    "mixtral-8x22b-v0.1": "mixtral-8x22b",
    "scaled_moe": "scaled-moe",
    "scaledmoe": "scaled-moe",
    "deepseek_v3": "deepseek-v3",
    "qwen3-235b": "qwen3-235b-a22b",
    "demo-model": "demo",
}


def preset_names() -> list[str]:
    return list(PRESETS)


def _dtype_bytes(raw: dict[str, Any]) -> float:
    quant = raw.get("quantization_config") or {}
    fmt = str(quant.get("fmt", "") or quant.get("quant_method", "")).lower()
    if "fp8" in fmt or "e4m3" in fmt:
        return 1.0
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16").lower()
    return {"float32": 4.0, "float": 4.0, "float16": 2.0, "half": 2.0, "bfloat16": 2.0}.get(dtype, 2.0)


def from_hf_config(raw: dict[str, Any], name: str | None = None, source: str = "config.json") -> ModelSpec:
    """Build a :class:`ModelSpec` from a parsed Hugging Face ``config.json``.

    Understands Mixtral, DBRX, Qwen2-MoE, Qwen3-MoE and DeepSeek-V2/V3 configs, and other configs
    that use the common key names (``num_local_experts``/``num_experts``/``n_routed_experts``).
    """
    mtype = str(raw.get("model_type", "")).lower()
    label = name or str(raw.get("_name_or_path") or mtype or "model")

    def get(*keys: str, default: Any = None, required: bool = True) -> Any:
        for k in keys:
            if raw.get(k) is not None:
                return raw[k]
        if required and default is None:
            raise ModelError(f"{source}: none of {keys} present (model_type={mtype!r})")
        return default

    bpp = _dtype_bytes(raw)
    if mtype == "dbrx":
        attn = raw.get("attn_config") or {}
        ffn = raw.get("ffn_config") or {}
        hidden = int(get("d_model"))
        heads = int(get("n_heads"))
        return ModelSpec(
            name=label,
            num_layers=int(get("n_layers")),
            hidden_size=hidden,
            intermediate_size=int(ffn["ffn_hidden_size"]),
            num_experts=int(ffn["moe_num_experts"]),
            top_k=int(ffn["moe_top_k"]),
            num_attention_heads=heads,
            num_kv_heads=int(attn.get("kv_n_heads", heads)),
            head_dim=hidden // heads,
            vocab_size=int(get("vocab_size")),
            max_position_embeddings=int(get("max_seq_len", default=4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bytes_per_param=bpp,
            source=source,
        )

    hidden = int(get("hidden_size"))
    heads = int(get("num_attention_heads"))
    kv_heads = int(get("num_key_value_heads", default=heads))
    head_dim = int(raw.get("head_dim") or hidden // heads)
    layers = int(get("num_hidden_layers"))
    experts = int(get("num_local_experts", "num_experts", "n_routed_experts"))
    top_k = int(get("num_experts_per_tok", "moe_top_k"))
    common: dict[str, Any] = dict(
        name=label,
        num_layers=layers,
        hidden_size=hidden,
        num_experts=experts,
        top_k=top_k,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(get("vocab_size")),
        max_position_embeddings=int(get("max_position_embeddings", default=4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bytes_per_param=bpp,
        source=source,
    )
    if mtype.startswith("deepseek"):
        n_shared = int(raw.get("n_shared_experts") or 0)
        moe_inter = int(get("moe_intermediate_size"))
        q_lora = raw.get("q_lora_rank")
        mla = MLAConfig(
            kv_lora_rank=int(get("kv_lora_rank")),
            qk_nope_head_dim=int(get("qk_nope_head_dim")),
            qk_rope_head_dim=int(get("qk_rope_head_dim")),
            v_head_dim=int(get("v_head_dim")),
            q_lora_rank=int(q_lora) if q_lora else None,
        )
        common["head_dim"] = mla.v_head_dim  # unused by MLA formulas; the per-head value width
        return ModelSpec(
            intermediate_size=moe_inter,
            num_shared_experts=n_shared,
            shared_intermediate_size=n_shared * moe_inter,
            num_dense_layers=int(raw.get("first_k_dense_replace") or 0),
            dense_intermediate_size=int(raw.get("intermediate_size") or 0),
            mla=mla,
            **common,
        )
    if "moe_intermediate_size" in raw:  # Qwen2-MoE / Qwen3-MoE style
        shared = int(raw.get("shared_expert_intermediate_size") or 0)
        mlp_only = raw.get("mlp_only_layers") or []
        step = int(raw.get("decoder_sparse_step", 1) or 1)
        n_dense = len(mlp_only) + (layers - layers // step if step > 1 else 0)
        return ModelSpec(
            intermediate_size=int(raw["moe_intermediate_size"]),
            num_shared_experts=1 if shared else 0,
            shared_intermediate_size=shared,
            num_dense_layers=n_dense,
            dense_intermediate_size=int(raw.get("intermediate_size") or 0) if n_dense else 0,
            **common,
        )
    return ModelSpec(intermediate_size=int(get("intermediate_size", "ffn_hidden_size")), **common)


def load_model_spec(name_or_path: str) -> ModelSpec:
    """A preset by name (case-insensitive, a few aliases), or a ``config.json`` file or folder."""
    key = name_or_path.strip().lower()
    key = _ALIASES.get(key, key)
    if key in PRESETS:
        return PRESETS[key]
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


def with_overrides(spec: ModelSpec, **changes: Any) -> ModelSpec:
    """A copy of ``spec`` with some fields changed (e.g. ``bytes_per_param=1``)."""
    return replace(spec, **changes)
