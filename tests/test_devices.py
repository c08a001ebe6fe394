"""``device`` / ``expert_device``: names checked up front, a missing CUDA device refused with a clear
error before anything loads, the CPU path running through the same device-moving code (metadata,
KV cache, sampling) token-identical to transformers, per-role devices in deployment specs."""

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.cluster.spec import DeploymentSpec
from afdserve.config import EngineConfig
from afdserve.errors import ConfigError, ModelError
from afdserve.backends.pytorch.attention import TorchAttention, _decode_keys
from afdserve.backends.pytorch.norm import TorchNorm
from afdserve.backends.step import StepBuffers, StepLayout
from afdserve.model.loader import parse_device

from tiny_models import hf_greedy


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "cuda:-1", "tpu", "", 0])
def test_bad_device_names_are_refused_naming_the_option(name):
    with pytest.raises(ConfigError, match="device"):
        EngineConfig(device=name)
    with pytest.raises(ConfigError, match="expert_device"):
        EngineConfig(expert_device=name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(tiny_mixtral):
    with pytest.raises(ModelError, match="sees no CUDA device"):
        parse_device("cuda:0")
    with pytest.raises(ModelError, match="sees no CUDA device"):
        LLM(str(tiny_mixtral), device="cuda", num_kv_blocks=64)


def test_colocated_engine_refuses_a_separate_expert_device(tiny_mixtral):
    with pytest.raises(ConfigError, match="expert_device"):
        LLM(str(tiny_mixtral), device="cpu", expert_device="cuda:1", num_kv_blocks=64)


def test_a_steps_context_is_staged_on_the_device_with_its_decode_keys_prepared():
    """The torch backend's context of a step: built on the host once, for every key window, and
    staged onto the device (the meta device, without data, stands in for a GPU: placement only)."""
    layout = StepLayout.from_blocks([1, 1], [5, 3], [[0, 1], [4]], 4)
    ctx = TorchAttention(TorchNorm()).prepare(layout, (0, 2), StepBuffers("meta"))
    assert ctx.positions.device.type == "meta" and ctx.slot_mapping.device.type == "meta"
    assert set(ctx.decode_kv) == {0, 2}  # prepared on the host: no read-back from the device per layer
    assert all(t.device.type == "meta" for pair in ctx.decode_kv.values() for t in pair)
    host = TorchAttention(TorchNorm()).prepare(layout, (0,), StepBuffers("cpu"))
    assert host.positions.tolist() == [4, 2] and host.slot_mapping.tolist() == [4, 18]


def test_explicit_cpu_device_is_token_identical_to_transformers(tiny_mixtral):
    prompts = [[5, 9, 13], list(range(3, 20))]
    want = hf_greedy(tiny_mixtral, prompts, 12)
    with LLM(str(tiny_mixtral), device="cpu", num_kv_blocks=32) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=12, temperature=0))
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_deployment_spec_sets_each_roles_device():
    spec = DeploymentSpec.from_dict({"attention": {"workers": 1, "device": "cuda:0"},
                                     "expert": {"workers": 2, "device": "cuda:1"}})
    cfg = EngineConfig(expert_workers=2)
    assert spec.worker_config("attention", cfg).device == "cuda:0"
    assert spec.worker_config("expert", cfg).expert_device == "cuda:1"
    assert spec.worker_config("expert", cfg).device == "cpu"
    assert 'device = "cuda:1"' in spec.to_toml()
    with pytest.raises(ConfigError, match="expert.device"):
        DeploymentSpec.from_dict({"attention": {"workers": 1}, "expert": {"workers": 1, "device": "gpu"}})


def test_attention_inputs_that_fused_cuda_kernels_misread_are_recognised():
    """The torch backend's ``sdpa`` sends these through the math backend on CUDA (an H200 raised a
    misaligned address for values sliced at an odd offset, the tiny DeepSeek-V3's)."""
    from afdserve.backends.pytorch.sdpa import _rows_aligned

    x = torch.randn(4, 8, 32)
    k, v = x.split([10, 22], -1)
    assert _rows_aligned(x) and _rows_aligned(torch.randn(3, 1, 5, 16))  # size-1 dims' strides do not count
    assert not _rows_aligned(k) and not _rows_aligned(v)  # 10 floats a row; v starts 10 floats in
    assert not _rows_aligned(torch.randn(5, 26))  # 104-byte rows


@pytest.mark.parametrize("window", [0, 5, 40])
def test_decode_keys_from_block_tables_match_each_sequences_own_slots(window):
    """The decodes' keys (whole-batch operations over the block tables) against each sequence's slots
    taken one by one: blocks scattered, released ones (-1) before the window, mixed with a prefill."""
    g = torch.Generator().manual_seed(window)
    bs, lens, qlens = 4, [1, 7, 30, 13, 2], [1, 1, 6, 1, 1]
    blocks = torch.randperm(64, generator=g).tolist()
    tables = [[blocks.pop() for _ in range(-(-n // bs))] for n in lens]
    if window:  # blocks wholly before the window were given back
        tables = [[-1 if (j + 1) * bs <= n - window else b for j, b in enumerate(t)] for t, n in zip(tables, lens)]
    layout = StepLayout.from_blocks(qlens, lens, tables, bs)
    slots, mask = _decode_keys(layout, layout.decode_seqs, window)
    for row, i in enumerate(layout.decode_seqs.tolist()):
        n = lens[i]
        own = [tables[i][p // bs] * bs + p % bs for p in range(max(0, n - window) if window else 0, n)]
        assert mask[row, 0, 0].sum() == len(own)
        assert slots[row, : len(own)].tolist() == own
        assert set(slots[row, len(own):].tolist()) <= {own[-1]}  # padded with its own last slot (masked)


def test_rope_frequencies_move_to_the_device_once():
    """A step's cos/sin on a device read the frequencies there: moved on the first step, not copied
    host to device (a copy the step waits on) every step. The meta device stands in for a GPU."""
    from afdserve.model.rope import Rope

    rope = Rope.from_config({"rope_theta": 10000.0}, 8, 64)
    rope.cos_sin(torch.arange(3, device="meta"), torch.float32)
    moved = rope.inv_freq
    assert moved.device.type == "meta"
    cos, _ = rope.cos_sin(torch.arange(5, device="meta"), torch.float32)
    assert rope.inv_freq is moved and tuple(cos.shape) == (5, 8)


def test_device_auto_is_cuda_where_torch_sees_a_gpu():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert EngineConfig().device == EngineConfig(device="auto").device == want
    assert EngineConfig(device="cpu").device == "cpu"
