"""RoPE scaling types against transformers: frequencies and attention factors, then greedy tokens
of tiny Mixtral / Qwen checkpoints configured with each type, colocated and disaggregated."""

import json
import random

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.errors import ModelError
from afdserve.backends.pytorch.norm import apply_rotary
from afdserve.model.rope import Rope, served_context

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16,
             "beta_slow": 1},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "mscale": 1.0,
                    "mscale_all_dim": 0.707},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


def _hf_config(arch, scaling, head_dim=16):
    from tiny_models import hf_config

    return hf_config(arch, rope_parameters={"rope_theta": 500.0, **scaling}, head_dim=head_dim)


@pytest.mark.parametrize("name", sorted(SCALINGS))
@pytest.mark.parametrize("style", ["rope_parameters", "rope_scaling"])
def test_frequencies_match_transformers(name, style):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = SCALINGS[name]
    hf = _hf_config("mixtral", dict(scaling))
    max_pos = hf.max_position_embeddings
    served = int(max_pos * scaling["factor"]) if name == "dynamic" else max_pos
    ref_inv, ref_attn = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu", seq_len=served)
    if style == "rope_parameters":
        raw = {"max_position_embeddings": max_pos, "rope_parameters": {"rope_theta": 500.0, **scaling}}
    else:  # pre-5 configs: rope_theta beside a rope_scaling dict naming its "type"
        old = {("type" if k == "rope_type" else k): v for k, v in scaling.items()}
        raw = {"max_position_embeddings": max_pos, "rope_theta": 500.0, "rope_scaling": old}
    assert served_context(raw) == served
    rope = Rope.from_config(raw, 16, served_context(raw))
    torch.testing.assert_close(rope.inv_freq, ref_inv.float(), rtol=1e-6, atol=0)
    assert rope.attention_factor == pytest.approx(ref_attn)
    cos, sin = rope.cos_sin(torch.arange(5), torch.float32)
    assert cos.shape == (5, 16)
    torch.testing.assert_close(cos[:, :1] ** 2 + sin[:, :1] ** 2,
                               torch.full((5, 1), ref_attn**2), rtol=1e-5, atol=1e-5)


def test_partial_rotary_and_bad_types():
    rope = Rope.from_config({"rope_theta": 10000.0}, 8, 64)
    cos, sin = rope.cos_sin(torch.arange(3), torch.float32)
    x = torch.randn(3, 2, 12)
    y = apply_rotary(x, cos, sin)
    assert torch.equal(y[..., 8:], x[..., 8:])  # unrotated tail
    assert torch.allclose(y[..., :8], apply_rotary(x[..., :8].contiguous(), cos, sin))
    with pytest.raises(ModelError, match="longrope"):
        Rope.from_config({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, 8, 64)
    with pytest.raises(ModelError, match="factor"):
        Rope.from_config({"rope_scaling": {"type": "linear"}}, 8, 64)


# -- generation: tiny checkpoints configured with each scaling type, token-identical to transformers --

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
CHECKPOINTS = [  # (architecture, scaling, written as pre-5 "rope_scaling")
    ("mixtral", "linear", False),
    ("mixtral", "llama3", True),
    ("qwen2_moe", "yarn_mscale", False),
    ("qwen3_moe", "yarn", True),
    ("qwen3_moe", "llama3", False),
]


def _prompts(lens=(3, 9, 17, 30), seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lens]


def _checkpoint(path, arch, name, old_style):
    from tiny_models import make_checkpoint

    make_checkpoint(path, arch, rope_parameters={"rope_theta": 500.0, **SCALINGS[name]})
    if old_style:  # rope_theta beside "rope_scaling": {"type": ...}, as configs before transformers 5
        raw = json.loads((path / "config.json").read_text())
        params = raw.pop("rope_parameters")
        raw["rope_theta"] = params.pop("rope_theta")
        params["type"] = params.pop("rope_type")
        raw["rope_scaling"] = params
        (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="module")
def llama3_qwen3(tmp_path_factory):
    from tiny_models import hf_greedy

    path = _checkpoint(tmp_path_factory.mktemp("qwen3_llama3"), "qwen3_moe", "llama3", False)
    ps = _prompts()
    return path, ps, hf_greedy(path, ps, 32)


@pytest.mark.torch_backend
@pytest.mark.parametrize("arch,name,old_style", CHECKPOINTS, ids=[f"{a}-{n}" + ("-old" if o else "")
                                                                    for a, n, o in CHECKPOINTS])
def test_scaled_rope_matches_transformers(tmp_path, arch, name, old_style):
    from tiny_models import hf_greedy

    path = _checkpoint(tmp_path / arch, arch, name, old_style)
    assert Rope.from_config(json.loads((path / "config.json").read_text()), 16, 512).rope_type == \
        SCALINGS[name]["rope_type"]
    ps = _prompts()
    ref = hf_greedy(path, ps, 32)
    with LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=13) as llm:  # chunked prefills too
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref


@pytest.mark.parametrize("gate", ["attention", "expert"])
def test_scaled_rope_disaggregated(llama3_qwen3, gate):
    path, ps, ref = llama3_qwen3
    with LLM(str(path), num_kv_blocks=64, attention_workers=2, expert_workers=2, micro_batches=2, gate=gate,
             max_num_batched_tokens=24) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
