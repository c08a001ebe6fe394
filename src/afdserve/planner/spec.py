"""Model specifications for the planner: the shapes that drive the performance model.

A :class:`ModelSpec` holds what Eqs. (1)-(8) of the MegaScale-Infer design need -- layers ``L``,
hidden size ``h``, expert intermediate size ``h'``, experts ``E``, top-k ``K``, GQA group size
``g`` -- plus what the memory model needs (shared experts, dense layers, embeddings, bytes per
parameter, latent KV for MLA models).

Specs come from a built-in preset (:mod:`afdserve.planner.presets`) or from a Hugging Face
``config.json`` (:mod:`afdserve.planner.spec_loader`).
"""

from __future__ import annotations

from dataclasses import dataclass

from afdserve.errors import ModelError

__all__ = ["MLAConfig", "ModelSpec"]


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
