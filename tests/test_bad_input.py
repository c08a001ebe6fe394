"""Bad input gets a clear error naming the problem, and the engine keeps serving."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from afdserve import LLM, SamplingParams
from afdserve.errors import ConfigError, ModelError, RequestError

OK = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture
def copy_model(tiny_mixtral, tmp_path):
    def make():
        dst = tmp_path / "m"
        shutil.copytree(tiny_mixtral, dst)
        return dst
    return make


def test_unknown_architecture(copy_model):
    p = copy_model()
    cfg = json.loads((p / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    (p / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="unsupported architecture.*LlamaForCausalLM"):
        LLM(str(p))


def _edit_tensor(p, name, fn):
    index = json.loads((p / "model.safetensors.index.json").read_text())["weight_map"]
    f = p / index[name]
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def test_missing_tensor(copy_model):
    p = copy_model()
    name = "model.layers.1.self_attn.o_proj.weight"
    index_file = p / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    _edit_tensor(p, name, lambda t: t.pop(name))
    del index["weight_map"][name]
    index_file.write_text(json.dumps(index))
    with pytest.raises(ModelError, match="missing tensor 'model.layers.1.self_attn.o_proj.weight'"):
        LLM(str(p))


def test_misshaped_tensor(copy_model):
    p = copy_model()
    name = "model.layers.0.block_sparse_moe.experts.3.w2.weight"
    _edit_tensor(p, name, lambda t: t.__setitem__(name, torch.zeros(64, 47)))
    with pytest.raises(ModelError, match=r"experts.3.w2.weight' has shape \[64, 47\], expected \[64, 48\]"):
        LLM(str(p))


def test_missing_model_folder(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_bad_config_names_the_field(tiny_mixtral):
    with pytest.raises(ConfigError, match="max_num_seqs"):
        LLM(str(tiny_mixtral), max_num_seqs=0)
    with pytest.raises(ConfigError, match="unknown option.*bogus"):
        LLM(str(tiny_mixtral), bogus=1)
    with pytest.raises(ConfigError, match="gate"):
        LLM(str(tiny_mixtral), gate="nowhere")


def test_bad_requests_then_engine_keeps_serving(tiny_mixtral):
    with LLM(str(tiny_mixtral), num_kv_blocks=64) as llm:
        good = llm.generate([{"prompt_token_ids": [5, 6, 7]}], OK)[0].outputs[0].token_ids
        with pytest.raises(RequestError, match="empty prompt"):
            llm.generate(["", "hello"], OK)
        with pytest.raises(RequestError, match="empty prompt"):
            llm.generate([{"prompt_token_ids": []}], OK)
        with pytest.raises(RequestError, match="max_tokens must be an integer >= 1"):
            llm.generate(["hello"], SamplingParams(max_tokens=0))
        with pytest.raises(RequestError, match="prompt has 600 tokens; the model's context is 512"):
            llm.generate([{"prompt_token_ids": [5] * 600}], OK)
        with pytest.raises(RequestError, match=r"token ids must be integers in \[0, 256\)"):
            llm.generate([{"prompt_token_ids": [5, 999]}], OK)
        with pytest.raises(RequestError, match="temperature"):
            SamplingParams(temperature=-1)
        with pytest.raises(RequestError, match="top_p"):
            SamplingParams(top_p=0)
        assert not llm.engine.has_unfinished()  # nothing half-queued by the failed calls
        assert llm.generate([{"prompt_token_ids": [5, 6, 7]}], OK)[0].outputs[0].token_ids == good


@pytest.mark.parametrize("experts", [0, 1], ids=["colocated", "1a+1e"])
def test_a_batch_with_one_bad_request_queues_none_of_it(tiny_mixtral, experts):
    """``generate``'s prompts are added together (one message per attention worker in a cluster):
    when the third's sampling params are refused, the first two are not left running either."""
    with LLM(str(tiny_mixtral), num_kv_blocks=64, expert_workers=experts) as llm:
        good = llm.generate([{"prompt_token_ids": [5, 6, 7]}], OK)[0].outputs[0].token_ids
        bad = SamplingParams(max_tokens=4, stop_token_ids=[999])  # past the vocabulary (256)
        with pytest.raises(RequestError, match="not in the vocabulary"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3, [OK, OK, bad])
        assert not llm.engine.has_unfinished()
        assert llm.generate([{"prompt_token_ids": [5, 6, 7]}], OK)[0].outputs[0].token_ids == good
