"""Model specs: presets against published sizes, HF config parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afdserve.errors import ModelError
from afdserve.planner import PRESETS, ModelSpec, from_hf_config, load_model_spec


@pytest.mark.parametrize(
    "name,billions",
    [("mixtral-8x22b", 141), ("dbrx", 132), ("scaled-moe", 317), ("deepseek-v3", 671), ("qwen3-235b-a22b", 235)],
)
def test_preset_sizes_match_published_totals(name: str, billions: float) -> None:
    assert PRESETS[name].total_params / 1e9 == pytest.approx(billions, rel=0.01)


def test_table4_shapes() -> None:
    for name, (L, h, E, K, hp) in {
        "mixtral-8x22b": (56, 6144, 8, 2, 16384),
        "dbrx": (40, 6144, 16, 4, 10752),
        "scaled-moe": (48, 8192, 32, 4, 8192),
    }.items():
        s = PRESETS[name]
        assert (s.num_layers, s.hidden_size, s.num_experts, s.top_k, s.intermediate_size) == (L, h, E, K, hp)
        assert s.bytes_per_param == 2


def test_demo_preset() -> None:
    d = PRESETS["demo"]
    assert (d.vocab_size, d.hidden_size, d.intermediate_size, d.num_layers) == (32000, 256, 1024, 8)
    assert (d.num_experts, d.top_k, d.num_attention_heads, d.num_kv_heads, d.head_dim) == (8, 2, 8, 2, 32)
    assert d.max_position_embeddings == 4096
    assert d.total_params / 1e6 == pytest.approx(68, rel=0.01)  # "~68M parameters"


def test_expert_and_attention_split() -> None:
    m = PRESETS["mixtral-8x22b"]
    assert m.expert_node_param_bytes(1) == 3 * 6144 * 16384 * 56 * 2
    assert m.total_params == m.attention_side_params + 8 * m.expert_params * 56
    d = PRESETS["deepseek-v3"]
    assert d.num_moe_layers == 58
    # the shared expert and the dense FFN layers live on the attention side
    assert d.attention_side_params > d.num_layers * d.attention_params_per_layer + 3 * d.dense_ffn_params_per_layer


MIXTRAL_CFG = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 32000,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def _same_shapes(a: ModelSpec, b: ModelSpec) -> None:
    for f in (
        "num_layers",
        "hidden_size",
        "intermediate_size",
        "num_experts",
        "top_k",
        "num_attention_heads",
        "num_kv_heads",
        "head_dim",
        "vocab_size",
        "num_shared_experts",
        "shared_intermediate_size",
        "num_dense_layers",
        "bytes_per_param",
        "mla",
    ):
        assert getattr(a, f) == getattr(b, f), f


def test_from_hf_config_mixtral_demo() -> None:
    _same_shapes(from_hf_config(MIXTRAL_CFG, name="demo"), PRESETS["demo"])


def test_demo_config_of_the_repo_matches_preset() -> None:
    demo = pytest.importorskip("afdserve.model.demo")
    _same_shapes(from_hf_config(demo.DEMO_CONFIG), PRESETS["demo"])


def test_from_hf_config_dbrx() -> None:
    raw = {
        "model_type": "dbrx",
        "d_model": 6144,
        "n_heads": 48,
        "n_layers": 40,
        "max_seq_len": 32768,
        "vocab_size": 100352,
        "attn_config": {"kv_n_heads": 8},
        "ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4},
        "torch_dtype": "bfloat16",
    }
    _same_shapes(from_hf_config(raw), PRESETS["dbrx"])


def test_from_hf_config_deepseek_v3() -> None:
    raw = {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 129280,
        "max_position_embeddings": 163840,
        "torch_dtype": "bfloat16",
        "quantization_config": {"fmt": "e4m3", "quant_method": "fp8"},
    }
    _same_shapes(from_hf_config(raw), PRESETS["deepseek-v3"])


def test_from_hf_config_qwen3_moe() -> None:
    raw = {
        "model_type": "qwen3_moe",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "torch_dtype": "bfloat16",
    }
    _same_shapes(from_hf_config(raw), PRESETS["qwen3-235b-a22b"])


def test_qwen2_moe_shared_expert() -> None:
    raw = {
        "model_type": "qwen2_moe",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "vocab_size": 151936,
    }
    s = from_hf_config(raw)
    assert s.num_shared_experts == 1 and s.shared_intermediate_size == 5632 and s.num_dense_layers == 0


def test_load_model_spec(tmp_path: Path) -> None:
    assert load_model_spec("Mixtral") is PRESETS["mixtral-8x22b"]
    assert load_model_spec("DBRX") is PRESETS["dbrx"]
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MIXTRAL_CFG))
    s = load_model_spec(str(folder))
    assert s.name == "tiny" and s.hidden_size == 256
    assert load_model_spec(str(folder / "config.json")).hidden_size == 256
    with pytest.raises(ModelError):
        load_model_spec("no-such-model")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelError):
        load_model_spec(str(folder))


def test_spec_validation() -> None:
    with pytest.raises(ModelError):
        ModelSpec("x", 1, 64, 64, 4, 5, 4, 4, 16, 100, 128)  # top_k > experts
    with pytest.raises(ModelError):
        ModelSpec("x", 1, 64, 64, 4, 2, 4, 3, 16, 100, 128)  # heads % kv heads
