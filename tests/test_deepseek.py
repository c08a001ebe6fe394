"""DeepSeek-V2 / V3: MLA over the latent paged cache, their routers, shared experts and dense first
layers, token-identical to transformers colocated and disaggregated; MLA's KV bytes from the
allocator and in the planner."""

import random

import numpy as np
import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.config import EngineConfig
from afdserve.engine.builder import build_colocated, kv_blocks
from afdserve.kvcache.cache import KVCache
from afdserve.backends.step import StepLayout
from afdserve.engine.runner import ModelInput
from afdserve.model.config import ModelConfig
from tiny_models import deepseek_config, hf_config, hf_greedy, make_deepseek_checkpoint

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.9, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}

# name -> (version, overrides): odd head counts, q_lora_rank or not, both V2 top-k methods, V3 with
# groups (topk_group < n_group and == n_group), a correction bias, dense first layers, YaRN
MODELS = {
    "v2_q_lora": (2, dict(rope_parameters=YARN | {"mscale": 0.7})),
    "v2_no_q_lora": (2, dict(q_lora_rank=None, topk_method="greedy", num_attention_heads=3, n_group=None,
                             topk_group=None, first_k_dense_replace=0, routed_scaling_factor=1.0)),
    "v3_yarn": (3, dict(rope_parameters=YARN, first_k_dense_replace=1)),
    "v3_plain": (3, dict(q_lora_rank=None, topk_group=4, rope_interleave=False, first_k_dense_replace=2,
                         num_hidden_layers=4, norm_topk_prob=False)),
}
# the disaggregated runs (slow: one cluster per model and gate)
DISAGG = ["v2_q_lora", "v2_no_q_lora", "v3_yarn"]


def _prompts(seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 9, 17, 30)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {name: make_deepseek_checkpoint(tmp_path_factory.mktemp(name), v, **over)
            for name, (v, over) in MODELS.items()}


@pytest.fixture(scope="module")
def references(models):
    ps = _prompts()
    return ps, {name: hf_greedy(path, ps, 32) for name, path in models.items()}


def _generate(llm, ps):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]


@pytest.mark.torch_backend
@pytest.mark.parametrize("name", list(MODELS))
def test_colocated_matches_transformers(models, references, name):
    ps, ref = references
    with LLM(str(models[name]), num_kv_blocks=64) as llm:
        kv = llm.engine.engine.runner.kv
        assert kv.is_latent  # the cache holds the latent, not K/V
        assert _generate(llm, ps) == ref[name]
    with LLM(str(models[name]), num_kv_blocks=64, max_num_batched_tokens=8) as llm:  # chunked prefills
        assert _generate(llm, ps) == ref[name]


@pytest.mark.parametrize("name", DISAGG)
@pytest.mark.parametrize("gate", ["attention", "expert"])
def test_disaggregated_matches_transformers(models, references, name, gate):
    ps, ref = references
    with LLM(str(models[name]), num_kv_blocks=64, attention_workers=2, expert_workers=2, micro_batches=2,
             gate=gate) as llm:
        assert _generate(llm, ps) == ref[name]
        stats = {n: s for n, s in llm.engine.worker_stats().items() if n.startswith("expert")}
    cfg = ModelConfig.from_pretrained(models[name])
    for s in stats.values():  # expert workers hold nothing for the dense layers and get no tokens there
        assert all(not s.experts[l] and not any(s.tokens_per_expert[l]) for l in cfg.dense_layers)
        assert all(s.experts[l] for l in cfg.moe_layers)
    assert sum(sum(s.tokens_per_expert[l]) for s in stats.values() for l in cfg.moe_layers) > 0


@pytest.mark.torch_backend
def test_prefill_and_absorbed_decode_logits(models):
    """Prefill (expanded latents) and decode (absorbed W_UK / W_UV) logits equal transformers'."""
    import transformers as tf

    path = models["v3_yarn"]
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = build_colocated(EngineConfig(model=str(path), num_kv_blocks=32)).engine
    p = _prompts(1)[3]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0]
    eng.blocks.reserve(7, len(p))
    table, bs = eng.blocks.batch_table([7]), eng.blocks.block_size
    prefill = StepLayout.of([len(p) - 1], [len(p) - 1], table, bs)
    ours = eng.runner.forward(ModelInput(np.array(p[:-1]), prefill, np.arange(len(p) - 1))).logits
    torch.testing.assert_close(ours, ref[:-1], rtol=1e-4, atol=1e-4)
    decode = StepLayout.of([1], [len(p)], table, bs)
    assert decode.is_decode
    ours = eng.runner.forward(ModelInput(np.array(p[-1:]), decode, np.arange(1))).logits
    torch.testing.assert_close(ours, ref[-1:], rtol=1e-4, atol=1e-4)


def test_bad_deepseek_configs_are_refused():
    from afdserve.errors import ModelError

    for over, msg in [(dict(n_group=3), "n_group=3 must divide"), (dict(topk_group=5), "topk_group=5"),
                      (dict(num_experts_per_tok=5, topk_group=1), "num_experts_per_tok"),
                      (dict(qk_rope_head_dim=5), "qk_rope_head_dim"), (dict(mlp_bias=True), "mlp_bias")]:
        raw = deepseek_config(3).to_dict() | over
        with pytest.raises(ModelError, match=msg):
            ModelConfig.from_dict(raw)
    with pytest.raises(ModelError, match="topk_method"):
        ModelConfig.from_dict(deepseek_config(2).to_dict() | {"topk_method": "noaux_tc"})


def test_softmax_scale_of_real_configs():
    """A released checkpoint's config (``rope_scaling`` with ``type``: yarn, mscale_all_dim): the
    softmax scale is transformers' (qk_head_dim ** -0.5 times mscale(factor, mscale_all_dim) ** 2)."""
    import json

    import transformers as tf

    raw = deepseek_config(3).to_dict()
    raw.pop("rope_parameters")
    raw |= {"rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                                                     "mscale": 1.0, "mscale_all_dim": 1.0,
                                                     "original_max_position_embeddings": 64}}
    ours = ModelConfig.from_dict(json.loads(json.dumps(raw))).mla.softmax_scale
    hf_cfg = tf.DeepseekV3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    attn = tf.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(hf_cfg, 0)
    assert ours == pytest.approx(attn.scaling, rel=1e-12) and ours != pytest.approx((10 + 6) ** -0.5)


def test_router_matches_transformers():
    """V3's routing (sigmoid, correction bias, groups) and V2's group-limited softmax, token by token."""
    import transformers as tf
    from afdserve.backends import choose
    from afdserve.model.router import Router

    torch.manual_seed(0)
    for version, over in [(3, {}), (3, dict(n_group=2, topk_group=1, norm_topk_prob=False)),
                          (2, {}), (2, dict(topk_method="greedy"))]:
        hf_cfg = deepseek_config(version, **over)
        cls = tf.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter if version == 3 else \
            tf.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter
        hf_router = cls(hf_cfg)
        torch.nn.init.normal_(hf_router.weight, std=0.3)
        ours = Router(ModelConfig.from_dict(hf_cfg.to_dict()), torch.float32)
        ours.weight.copy_(hf_router.weight)
        if version == 3:
            hf_router.e_score_correction_bias.copy_(torch.rand(hf_cfg.n_routed_experts) - 0.5)
            ours.bias.copy_(hf_router.e_score_correction_bias)
        ours.prepare(choose("cpu", torch.float32))
        y = torch.randn(50, hf_cfg.hidden_size)
        _, w_ref, ids_ref = hf_router(y)
        ids, w = ours(y)
        o_ref, o = ids_ref.sort(dim=1).indices, ids.sort(dim=1).indices
        assert torch.equal(ids.gather(1, o), ids_ref.gather(1, o_ref))
        torch.testing.assert_close(w.gather(1, o), w_ref.gather(1, o_ref))


def test_mla_kv_bytes_from_the_allocator():
    """MLA's cache holds (kv_lora_rank + qk_rope_head_dim) values per token and layer, and the same
    kv_cache_gb admits correspondingly more tokens than a GQA model of the same hidden size."""
    mla_cfg = ModelConfig.from_dict(deepseek_config(3, hidden_size=64, num_attention_heads=4).to_dict())
    gqa_cfg = ModelConfig.from_dict(hf_config("mixtral", num_hidden_layers=3).to_dict())
    assert mla_cfg.hidden_size == gqa_cfg.hidden_size and mla_cfg.num_layers == gqa_cfg.num_layers
    ecfg = EngineConfig(kv_cache_gb=0.002, block_size=16, dtype="float32")
    per_token = {}
    tokens = {}
    for name, cfg in (("mla", mla_cfg), ("gqa", gqa_cfg)):
        n = kv_blocks(ecfg, cfg, 64)
        kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, n, ecfg.block_size, torch.float32,
                     cfg.kv_latent_dim)
        per_token[name] = kv.bytes_per_token_per_layer()
        held = sum(t.numel() * t.element_size() for t in kv.tensors())
        assert held == n * ecfg.block_size * cfg.num_layers * per_token[name] <= ecfg.kv_cache_gb * 2**30
        tokens[name] = n * ecfg.block_size
    m = mla_cfg.mla
    assert per_token["mla"] == (m.kv_lora_rank + m.qk_rope_head_dim) * 4
    assert per_token["gqa"] == 2 * gqa_cfg.num_kv_heads * gqa_cfg.head_dim * 4
    ratio = per_token["gqa"] / per_token["mla"]
    assert tokens["mla"] > tokens["gqa"]
    assert abs(tokens["mla"] / tokens["gqa"] - ratio) < 0.05 * ratio  # up to whole blocks
    # DeepSeek-V3's shapes in bf16: 576 values = 1152 bytes per token and layer (~69 KiB over 61 layers)
    full = KVCache(61, 128, 64, 1, 1, torch.bfloat16, latent_dim=512 + 64)
    assert full.bytes_per_token_per_layer() == 1152


def test_plan_reads_deepseek_folders(models, capsys):
    """``afdserve plan --model PATH`` reads a DeepSeek folder; its spec's KV bytes are the allocator's."""
    from afdserve.cli.main import main
    from afdserve.planner import load_model_spec

    for name in ("v2_q_lora", "v3_yarn"):
        path = models[name]
        spec = load_model_spec(str(path))
        cfg = ModelConfig.from_pretrained(path)
        kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1, 1, torch.bfloat16, cfg.kv_latent_dim)
        assert spec.mla is not None and spec.kv_bytes == 2.0
        assert spec.kv_bytes_per_token_layer == kv.bytes_per_token_per_layer()
        assert spec.num_dense_layers == len(cfg.dense_layers)
        assert main(["plan", "--model", str(path), "--gpus", "A800", "--top", "2"]) == 0
        assert path.name in capsys.readouterr().out
