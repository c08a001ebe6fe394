"""gpt-oss against transformers: attention sinks, sliding and full attention alternating (window
8, shorter than prompt + output), biases in attention, router and experts, the clamped SwiGLU,
YaRN — colocated and disaggregated (both gate placements); MXFP4 experts dequantized at load,
other quantizations refused."""

import json

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.errors import ModelError
from afdserve.model.config import ModelConfig
from afdserve.backends.base import Activation
from afdserve.backends.pytorch.moe import GroupedExperts
from afdserve.model.loader import CheckpointReader
from afdserve.model.model import ExpertModel, regroup_experts
from tiny_models import hf_greedy, make_gpt_oss_checkpoint, mxfp4_twins, prompts

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)



@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = make_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss"))
    ps = prompts()
    return path, ps, hf_greedy(path, ps, 32)


def test_config(gpt_oss):
    path, _, _ = gpt_oss
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.family == "gpt_oss" and cfg.sliding_windows == (8, 0, 8) and cfg.kv_window == 0
    assert cfg.attention_sinks and cfg.router_bias and cfg.expert_bias and cfg.o_proj_bias


@pytest.mark.torch_backend
@pytest.mark.parametrize("budget,block_size", [(2048, 16), (7, 4)])  # whole prefills; chunked prefills
def test_matches_transformers(gpt_oss, budget, block_size):
    path, ps, ref = gpt_oss
    with LLM(str(path), num_kv_blocks=128, block_size=block_size, max_num_batched_tokens=budget) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref


@pytest.mark.parametrize("gate", [pytest.param("attention", marks=pytest.mark.torch_backend), "expert"])
def test_disaggregated_matches_transformers(gpt_oss, gate):
    path, ps, ref = gpt_oss
    with LLM(str(path), num_kv_blocks=64, attention_workers=2, expert_workers=2, micro_batches=2, gate=gate,
             max_num_batched_tokens=24) as llm:  # small budget: chunked prefills split across micro-batches
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_experts_travel_with_their_biases(gpt_oss):
    """An expert worker's experts (a subset, then re-grouped) carry the same tensors as a full load."""
    path, _, _ = gpt_oss
    cfg = ModelConfig.from_pretrained(path)
    reader = CheckpointReader(path)
    full = ExpertModel.load(path, None, "float32", cfg, reader)
    part = ExpertModel.load(path, [1, 4], "float32", cfg, reader)
    moved = regroup_experts(part, [[4, 0, 5]] * cfg.num_layers, reader)
    for layer in range(cfg.num_layers):
        for j, e in enumerate(moved.layers[layer].expert_ids):
            for a, b in zip(moved.layers[layer].weights(j), full.layers[layer].weights(e)):
                assert torch.equal(a, b)
        assert len(moved.layers[layer].weights(0)) == 4  # gate_up, down and their biases


@pytest.mark.parametrize("hidden,inter", [(64, 32), (6, 4)])  # aligned rows; else padded once, when packed
def test_grouped_experts_with_bias_and_clamp(hidden, inter):
    torch.manual_seed(0)
    n, counts = 3, torch.tensor([4, 0, 5])
    x = torch.randn(int(counts.sum()), hidden) * 3
    w1, w2 = torch.randn(n, 2 * inter, hidden), torch.randn(n, hidden, inter)
    b1, b2 = torch.randn(n, 2 * inter), torch.randn(n, hidden)
    act = Activation("swiglu_oai", 1.702, 1.5)
    want = []
    for j, rows in enumerate(x.split(counts.tolist())):
        gate, up = (rows @ w1[j].T + b1[j]).chunk(2, dim=-1)
        gate, up = gate.clamp(max=1.5), up.clamp(-1.5, 1.5)
        want.append(((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ w2[j].T + b2[j])
    experts = GroupedExperts(w1, w2, b1, b2, act)
    got = experts._swiglu(torch.nn.functional.pad(x, (0, experts.pad_h)), counts)[:, :hidden]
    torch.testing.assert_close(got, torch.cat(want))


def test_mxfp4_checkpoint_dequantized_at_load(tmp_path_factory):
    """openai's MXFP4 expert layout: dequantized at load to exactly what transformers dequantizes,
    then the tokens of transformers on the dequantized twin."""
    src = make_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss_64"), intermediate_size=64)
    quantized, reference = tmp_path_factory.mktemp("mxfp4"), tmp_path_factory.mktemp("mxfp4_ref")
    mxfp4_twins(src, quantized, reference)
    ours = ExpertModel.load(quantized, None, "float32")
    want = ExpertModel.load(reference, None, "float32")
    for a, b in zip(ours.layers, want.layers):
        assert torch.equal(a.w_gate_up, b.w_gate_up) and torch.equal(a.w_down, b.w_down)
        assert torch.equal(a.b_gate_up, b.b_gate_up)
    ps = prompts((3, 17))
    with LLM(str(quantized), num_kv_blocks=64) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(reference, ps, 32)


def test_other_quantizations_refused(gpt_oss):
    path, _, _ = gpt_oss
    raw = json.loads((path / "config.json").read_text())
    with pytest.raises(ModelError, match="awq"):
        ModelConfig.from_dict(raw | {"quantization_config": {"quant_method": "awq", "bits": 4}})
    mixtral = raw | {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                     "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(ModelError, match="mxfp4"):
        ModelConfig.from_dict(mixtral)
