"""The planner's built-in model presets (:data:`PRESETS`), by name.

Sources:

* mixtral-8x22b, dbrx, scaled-moe: layers/hidden/experts/top-k/intermediate from Table 4 of the
  MegaScale-Infer paper; attention shapes and vocab from the public HF configs
  (mistralai/Mixtral-8x22B-v0.1, databricks/dbrx-base).  bf16 everywhere (paper §7.1).
* scaled-moe: Table 4 gives only L=48, h=8192, E=32, K=4, h'=8192.  The paper says it "shares a
  similar structure" with the others; we assume head_dim 128 (64 heads), 8 KV heads and a 32768
  vocab, which brings the total to 317B -- the size the paper states.
* deepseek-v3: HF deepseek-ai/DeepSeek-V3 config.json (MLA, 256 routed + 1 shared expert, first 3
  layers dense, fp8 weights as released).
* qwen3-235b-a22b: HF Qwen/Qwen3-235B-A22B config.json.
* demo: this repository's demo model (afdserve.model.demo.DEMO_CONFIG).
"""

from __future__ import annotations

from afdserve.planner.spec import MLAConfig, ModelSpec

__all__ = ["PRESETS", "preset"]

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
        source="MegaScale-Infer Table 4 (attention shape and vocab assumed, see presets.py)",
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


def preset(name: str) -> ModelSpec | None:
    """The preset called ``name`` (case-insensitive, a few aliases), or None."""
    key = name.strip().lower()
    return PRESETS.get(_ALIASES.get(key, key))
