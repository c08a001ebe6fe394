"""Dense layers inside MoE models (Qwen2-MoE ``decoder_sparse_step``, Qwen3-MoE ``mlp_only_layers``):
their MLP runs on the attention side with nothing dispatched, colocated and in both pipelines;
expert workers hold nothing for them; routing stats and re-placement cope."""

import random

import pytest

from afdserve import LLM, SamplingParams
from afdserve.model.config import ModelConfig
from afdserve.model.loader import CheckpointReader
from afdserve.model.model import ExpertModel, regroup_experts
from tiny_models import hf_greedy, make_checkpoint

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
MODELS = {
    "qwen2_moe": dict(decoder_sparse_step=2, num_hidden_layers=4, layer_types=["full_attention"] * 4),
    "qwen3_moe": dict(mlp_only_layers=[0, 3], num_hidden_layers=4, layer_types=["full_attention"] * 4),
}


def _prompts(seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 9, 17, 30)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {arch: make_checkpoint(tmp_path_factory.mktemp(arch + "_dense"), arch, **over)
            for arch, over in MODELS.items()}


@pytest.fixture(scope="module")
def references(models):
    ps = _prompts()
    return ps, {arch: hf_greedy(path, ps, 32) for arch, path in models.items()}


def _generate(llm, ps):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("step,only", [(1, []), (2, []), (3, [1]), (1, [0, 4]), (2, [5])])
def test_dense_layer_rule_matches_transformers(arch, step, only):
    import transformers as tf

    cls, cfg_cls, moe_block = {
        "qwen2_moe": (tf.Qwen2MoeModel, tf.Qwen2MoeConfig, tf.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock),
        "qwen3_moe": (tf.Qwen3MoeModel, tf.Qwen3MoeConfig, tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock),
    }[arch]
    hf_cfg = cfg_cls(vocab_size=32, hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_experts=4,
                     num_experts_per_tok=2, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                     decoder_sparse_step=step, mlp_only_layers=only)
    ours = ModelConfig.from_dict(hf_cfg.to_dict())
    hf_moe = [isinstance(layer.mlp, moe_block) for layer in cls(hf_cfg).layers]
    assert [ours.is_moe(l) for l in range(6)] == hf_moe
    assert ours.dense_intermediate_size == (24 if not all(hf_moe) else 0)


@pytest.mark.torch_backend
@pytest.mark.parametrize("arch", list(MODELS))
def test_colocated_matches_transformers(models, references, arch):
    ps, ref = references
    cfg = ModelConfig.from_pretrained(models[arch])
    assert cfg.dense_layers and cfg.moe_layers
    with LLM(str(models[arch]), num_kv_blocks=64) as llm:
        assert _generate(llm, ps) == ref[arch]
        counts = llm.engine.experts.counts  # tokens routed per (layer, expert) in this process
    assert all(int(counts[l].sum()) == 0 for l in cfg.dense_layers)
    assert all(int(counts[l].sum()) > 0 for l in cfg.moe_layers)


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("gate", ["attention", "expert"])
def test_disaggregated_matches_transformers(models, references, arch, gate):
    ps, ref = references
    cfg = ModelConfig.from_pretrained(models[arch])
    with LLM(str(models[arch]), num_kv_blocks=64, attention_workers=2, expert_workers=2, micro_batches=2,
             gate=gate) as llm:
        assert _generate(llm, ps) == ref[arch]
        stats = {n: s for n, s in llm.engine.worker_stats().items() if n.startswith("expert")}
        for s in stats.values():  # nothing held, nothing received for the dense layers
            assert all(not s.experts[l] and not any(s.tokens_per_expert[l]) for l in cfg.dense_layers)
            assert all(s.experts[l] for l in cfg.moe_layers)
        if gate == "attention" and arch == "qwen2_moe":
            # re-placement planned from the recorded load (zero for the dense layers) with replicas
            llm.engine.rebalance(slots_per_worker=4)
            assert _generate(llm, ps) == ref[arch]
            stats = {n: s for n, s in llm.engine.worker_stats().items() if n.startswith("expert")}
            assert all(not s.experts[l] for s in stats.values() for l in cfg.dense_layers)


def test_expert_model_holds_nothing_for_dense_layers(models):
    path = models["qwen3_moe"]
    cfg, reader = ModelConfig.from_pretrained(path), CheckpointReader(path)
    everything = [list(range(cfg.num_experts))] * cfg.num_layers
    experts = ExpertModel.load(path, everything, cfg=cfg, reader=reader)
    for l, part in enumerate(experts.layers):
        assert part.expert_ids == ([] if l in cfg.dense_layers else everything[l])
        assert part.w_gate_up.numel() == 0 or cfg.is_moe(l)
    regrouped = regroup_experts(experts, [[0, 1]] * cfg.num_layers, reader)
    assert [p.expert_ids for p in regrouped.layers] == [[] if l in cfg.dense_layers else [0, 1]
                                                        for l in range(cfg.num_layers)]


def test_planner_spec_counts_the_dense_layers(models):
    from afdserve.planner import load_model_spec

    for arch, path in models.items():
        cfg, spec = ModelConfig.from_pretrained(path), load_model_spec(str(path))
        assert spec.num_dense_layers == len(cfg.dense_layers) == 2
        assert spec.num_moe_layers == len(cfg.moe_layers)
        assert spec.dense_intermediate_size == cfg.dense_intermediate_size > 0
