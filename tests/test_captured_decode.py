"""The colocated engine's captured decode steps (``afdserve.engine.padded``, ``afdserve.engine.graphs``)
on the CPU: the padded decode step compiled whole per padded batch size (what a CUDA graph captures;
the triton kernels interpreted), float32 greedy tokens as transformers', no graph break and no
recompilation while the batch changes within a size; the padded step's tokens, expert counts and
load window as the eager step's; a capture that fails or whose outputs differ from the eager step's
is refused. On a GPU: CUDA graphs against transformers."""

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.backends.capture import capture_blocker, choose_capture
from afdserve.cli.main import build_parser
from afdserve.config import EngineConfig
from afdserve.engine import builder
from afdserve.engine.padded import PaddedDecode, batch_sizes
from afdserve.errors import ConfigError
from afdserve.kvcache.cache import KVCache
from tiny_models import compiled_generate, hf_greedy, make_gpt_oss_checkpoint, prompts



def test_padded_batch_sizes():
    assert batch_sizes(1) == [1]
    assert batch_sizes(4) == [1, 2, 4]
    assert batch_sizes(6) == [1, 2, 4, 6]
    assert batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]


def test_scratch_block_is_outside_the_pool():
    kv = KVCache(2, 2, 8, 5, 4, torch.float32, scratch=True)
    assert kv.num_blocks == 5 and kv.scratch_block == 5 and kv.keys(0).shape[0] == 6 * 4
    assert kv.layer_blocks(1)[0].shape == (5, 4, 2, 8)  # what transfers move: the pool's blocks only
    assert KVCache(2, 2, 8, 5, 4, torch.float32).scratch_block is None


def test_enforce_eager_option():
    assert EngineConfig(device="cpu").enforce_eager is False
    with pytest.raises(ConfigError, match="enforce_eager"):
        EngineConfig(device="cpu", enforce_eager="yes")
    args = build_parser().parse_args(["generate", "--enforce-eager", "--prompt", "x"])
    assert args.enforce_eager is True


def _spy_sizes(monkeypatch) -> list[tuple[int, int]]:
    """Every captured step's (sequences, padded size)."""
    seen: list[tuple[int, int]] = []
    write = PaddedDecode.write

    def spy(self, inp, b):
        seen.append((inp.layout.num_seqs, b))
        return write(self, inp, b)

    monkeypatch.setattr(PaddedDecode, "write", spy)
    return seen


def test_decode_step_compiles_whole_per_padded_size(tiny_mixtral, monkeypatch):
    """compile=True with the triton attention backend: the padded decode step (embeddings, every
    layer with the Triton kernels as custom ops and the torch MoE, the head) compiled with
    fullgraph=True, dynamic=False once per padded size and variant at start-up; 100 decode steps
    whose batch shrinks from 4 to 1 (3 runs at size 4) served by those graphs alone."""
    ps = prompts()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (100, 12, 45, 70)]
    ref = [r[:p.max_tokens] for r, p in zip(hf_greedy(tiny_mixtral, ps, 100), params)]
    spied: list[list[tuple[int, int]]] = []

    def captured(llm):
        assert llm.engine.engine.runner.captured is not None
        spied.append(_spy_sizes(monkeypatch))  # installed after start-up: the served steps only

    got, counters = compiled_generate(tiny_mixtral, ps, params, captured, num_kv_blocks=64, backend="triton",
                                      compile=True, max_num_seqs=4)
    assert got == ref
    assert counters["stats"]["unique_graphs"] == 2 * len(batch_sizes(4)), counters["stats"]
    assert not counters.get("graph_break"), counters.get("graph_break")
    seen = spied[0]
    assert {(3, 4), (4, 4), (2, 2), (1, 1)} <= set(seen) and len(seen) >= 95, sorted(set(seen))


class Uncaptured:
    """The padded step run as it is (no capture): what ``CapturedDecode`` does, in eager time."""

    name = "uncaptured"

    def capture(self, fn):
        return fn


class Wrong(Uncaptured):
    """A capture whose greedy tokens are off by one."""

    name = "wrong"

    def capture(self, fn):
        return lambda: fn() + (1 if fn.args[1] else 0)


def _run(path, mechanism=None, monkeypatch=None, **kw):
    if mechanism is not None:
        monkeypatch.setattr(builder, "choose_capture", lambda *a, **k: mechanism)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (14, 5, 9)]
    params.append(SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True))
    with LLM(str(path), num_kv_blocks=64, backend="triton", dtype="float32", max_num_seqs=4, **kw) as llm:
        captured = llm.engine.engine.runner.captured is not None
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params)
        snap = llm.engine.experts.tracker.snapshot()
        counts = llm.engine.experts.counts.clone()
    return [list(o.outputs[0].token_ids) for o in outs], snap, counts, captured


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """Sinks, a sliding window, a router bias."""
    path = make_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss_graphs"))
    return path, _run(path)


def test_padded_step_is_the_eager_step(gpt_oss, monkeypatch):
    """The padded step (sizes 1, 2, 4 of max_num_seqs=4: 3 sequences with a padded row; a sampled row
    among greedy ones): the tokens, the expert counts and the load window (co-activation included)
    of the eager step."""
    path, (ref, ref_snap, ref_counts, was) = gpt_oss
    assert not was  # the CPU without compile: eager
    seen = _spy_sizes(monkeypatch)
    tokens, snap, counts, captured = _run(path, Uncaptured(), monkeypatch)
    assert captured and {(4, 4), (3, 4), (2, 2), (1, 1)} <= set(seen)
    assert tokens == ref
    assert torch.equal(counts, ref_counts) and snap.steps == ref_snap.steps
    np.testing.assert_array_equal(snap.tokens, ref_snap.tokens)
    np.testing.assert_array_equal(snap.coactivation, ref_snap.coactivation)


class Broken(Uncaptured):
    name = "broken"

    def capture(self, fn):
        raise RuntimeError("no graphs here")


@pytest.mark.parametrize("mechanism,why", [
    (Wrong(), "CaptureMismatch: batch size 4: the captured greedy tokens"),
    (Broken(), "RuntimeError: no graphs here")])
def test_a_failed_capture_warns_and_runs_eager(gpt_oss, monkeypatch, mechanism, why):
    """A capture whose outputs are not the eager step's, or that raises: a warning, and every step
    eager (the eager run's tokens)."""
    path, (ref, *_) = gpt_oss
    with pytest.warns(RuntimeWarning, match=f"{mechanism.name} capture of the decode step failed, running eager: {why}"):
        tokens, _, _, captured = _run(path, mechanism, monkeypatch)
    assert not captured and tokens == ref


def test_no_capture_where_the_grouped_gemm_reads_back(monkeypatch):
    """On CUDA, ``torch._grouped_mm`` outside its bfloat16 kernels (sm9x / sm10x) loops over the groups
    on the host, reading the offsets back, which a CUDA graph cannot capture: decided when the engine
    is built (nothing captured, no warning of a failed capture); compiled on the CPU it is a custom op."""
    backends = SimpleNamespace(attention=SimpleNamespace(name="triton"), moe=SimpleNamespace(name="torch"))
    cuda = torch.device("cuda")
    for dtype in (torch.float32, torch.float16):
        assert "reads its group offsets back" in capture_blocker(backends, False, cuda, dtype)
        assert choose_capture(cuda, backends, eager=False, compile=False, fp8_kv=False, dtype=dtype, functions=2) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "reads its group offsets back" in capture_blocker(backends, False, cuda, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert capture_blocker(backends, False, cuda, torch.bfloat16) == ""
    assert capture_blocker(backends, False, torch.device("cpu"), torch.float32) == ""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_on_a_gpu(tiny_mixtral):
    """On a GPU: in float32 nothing is captured (``torch._grouped_mm`` reads its offsets back), without
    a warning, and the greedy tokens are transformers'; in bfloat16 (on sm9x / sm10x) the decode steps
    are captured in CUDA graphs by default, their start-up check against the eager step passed (no
    warning), and every request is served; with enforce_eager nothing is captured."""
    ps = prompts()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 12, 25, 30)]
    ref = [r[:p.max_tokens] for r, p in zip(hf_greedy(tiny_mixtral, ps, 40, device="cuda"), params)]
    kernels = torch.cuda.get_device_capability()[0] in (9, 10)
    for dtype, eager in (("float32", False), ("bfloat16", False), ("bfloat16", True)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            with LLM(str(tiny_mixtral), num_kv_blocks=64, device="cuda", dtype=dtype, attention_backend="triton",
                     max_num_seqs=8, enforce_eager=eager) as llm:
                captured = llm.engine.engine.runner.captured is not None
                outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
        assert captured == (dtype == "bfloat16" and kernels and not eager), (dtype, eager)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        if dtype == "float32":
            assert tokens == ref
        assert [len(t) for t in tokens] == [p.max_tokens for p in params], (dtype, eager)
