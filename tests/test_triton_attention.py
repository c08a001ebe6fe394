"""The triton backends (attention and norms), their kernels run on CPU tensors by Triton's interpreter
(conftest sets TRITON_INTERPRET=1 before anything imports triton): the paged-attention kernel
against the torch backend over mixed batches (prefill pieces after cached prefixes, decodes, GQA,
windows, sinks, given-back blocks poisoned with NaN), RMS norm (with the residual add) and RoPE
with the cache write (partial rotary, Qwen3's q/k norms) against the torch norm backend, greedy
tokens as transformers' in the colocated and the disaggregated deployments, and the decode half
compiled whole (one graph, no break) with the kernels as custom ops where decode steps are not
captured (``enforce_eager``, or an attention worker). The captured decode step compiled whole:
tests/test_captured_decode.py."""

import random

import numpy as np
import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.backends import choose
from afdserve.backends.pytorch.attention import TorchAttention
from afdserve.backends.pytorch.norm import TorchNorm
from afdserve.backends.step import StepBuffers, StepLayout
from afdserve.errors import ConfigError
from tiny_models import compiled_generate, hf_greedy, make_gpt_oss_checkpoint, prompts

NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)



def _batch(seed: int, block_size: int, window: int):
    """A flat batch of random pieces: some decodes, some prefills after a cached prefix; blocks wholly
    before a window are given back (-1 in the table) and their slots in the cache are NaN."""
    rng = np.random.default_rng(seed)
    s = int(rng.integers(1, 7))
    q_lens = np.where(rng.random(s) < 0.5, 1, rng.integers(2, 40, s))
    kv_lens = q_lens + rng.integers(0, 50, s)
    n_blocks = int(sum(-(-k // block_size) for k in kv_lens)) + 3
    perm = rng.permutation(n_blocks).tolist()
    tables, dead = [], []
    for q, kv in zip(q_lens, kv_lens):
        n = -(-int(kv) // block_size)
        t, perm = perm[:n], perm[n:]
        if window:  # blocks no query of the piece can see any more
            first_key = max(0, int(kv - q) - window + 1)
            gone = first_key // block_size
            dead += t[:gone]
            t = [-1] * gone + t[gone:]
        tables.append(t)
    return StepLayout.from_blocks(q_lens, kv_lens, tables, block_size), n_blocks, dead


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 24), (6, 1, 32)])
@pytest.mark.parametrize("window,sinks", [(0, False), (7, True), (0, True), (20, False)])
def test_kernel_matches_the_torch_backend(dtype, heads, kv_heads, head_dim, window, sinks):
    triton_attn = choose("cpu", dtype, "torch", attention="triton").attention
    ref = TorchAttention(TorchNorm())
    for seed in range(3):
        block_size = (4, 16, 5)[seed]
        layout, n_blocks, dead = _batch(seed + 10 * heads + window, block_size, window)
        g = torch.Generator().manual_seed(seed)
        k = torch.randn(n_blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n_blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)
        q = torch.randn(layout.num_tokens, heads, head_dim, generator=g).to(dtype)
        sink = torch.randn(heads, generator=g) if sinks else None
        want = ref.attend(q, k, v, ref.prepare(layout, (window,), StepBuffers("cpu")), window, sink, 0.3)
        for b in dead:  # never read, even masked
            k[b * block_size:(b + 1) * block_size] = float("nan")
            v[b * block_size:(b + 1) * block_size] = float("nan")
        got = triton_attn.attend(q, k, v, triton_attn.prepare(layout, (window,), StepBuffers("cpu")), window, sink, 0.3)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_kernels_match_the_torch_backend(dtype):
    norm, ref = choose("cpu", dtype, "triton").norm, TorchNorm()
    g = torch.Generator().manual_seed(0)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.05, atol=0.1)
    for rows, cols in ((1, 64), (7, 96), (33, 200)):
        x, r = (torch.randn(rows, cols, generator=g).to(dtype) for _ in range(2))
        w = (1 + 0.1 * torch.randn(cols, generator=g)).to(dtype)
        torch.testing.assert_close(norm.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), **tol)
        for got, want in zip(norm.add_rms_norm(x, r, w, 1e-6), ref.add_rms_norm(x, r, w, 1e-6)):
            torch.testing.assert_close(got, want, **tol)
    for heads, kv_heads, d, rotary, qk_norm in ((4, 2, 16, 16, False), (8, 2, 32, 16, True), (6, 3, 24, 24, True)):
        t, slots = 5, torch.tensor([3, 9, 0, 12, 7])
        qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
        angle = torch.rand(t, rotary // 2, generator=g) * 6.3
        cos, sin = (torch.cat([f(angle)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
        norms = [(1 + 0.1 * torch.randn(d, generator=g)).to(dtype) for _ in range(2)] if qk_norm else [None, None]
        caches = [[torch.full((16, kv_heads, d), float("nan"), dtype=dtype) for _ in range(2)] for _ in range(2)]
        q = [b.rope_cache(qkv, cos, sin, *c, slots, heads, kv_heads, *norms, 1e-6)
             for b, c in ((norm, caches[0]), (ref, caches[1]))]
        torch.testing.assert_close(q[0], q[1], **tol)
        for got, want in zip(caches[0], caches[1]):  # written at the slots, nothing else touched
            torch.testing.assert_close(got, want, equal_nan=True, **tol)


def test_choosing_triton():
    b = choose("cpu", torch.float32, "torch", attention="triton")
    assert b.names() == {"attention": "triton", "moe": "torch", "linear": "torch", "norm": "torch"}
    assert choose("cpu", torch.float32, "triton").names() == {"attention": "triton", "moe": "torch",
                                                             "linear": "torch", "norm": "triton"}
    with pytest.raises(ConfigError, match="triton is an attention backend"):
        choose("cpu", torch.float32, moe="triton")
    with pytest.raises(ConfigError, match="invalid attention backend 'triton': .*MLA"):
        choose("cpu", torch.float32, attention="triton", latent=True)
    with pytest.raises(ConfigError, match="needs it compiled"):  # this process interprets Triton
        choose("cuda", torch.float32, attention="triton")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """Sinks, sliding and full layers alternating (window 8)."""
    path = make_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss_triton"))
    return path, hf_greedy(path, prompts(), NEW)


def generate(path, **kw) -> list[list[int]]:
    kw = {"attention_backend": "triton"} | kw
    with LLM(str(path), **kw) as llm:
        assert llm.engine.engine.runner.model.backends.attention.name == "triton" if kw.get(
            "expert_workers", 0) == 0 else True
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("backends", [{"attention_backend": "triton"}, {"backend": "triton"}])
def test_greedy_matches_transformers(tiny_model, backends):
    """The triton attention beside the other default backends; triton attention and norms with
    torch linear and MoE."""
    _, path = tiny_model
    assert generate(path, num_kv_blocks=64, **backends) == hf_greedy(path, prompts(), NEW)


@pytest.mark.parametrize("budget,block_size", [(2048, 16), (7, 4)])  # whole prefills; chunked prefills
def test_sinks_and_windows_match_transformers(gpt_oss, budget, block_size):
    path, ref = gpt_oss
    assert generate(path, num_kv_blocks=160, block_size=block_size, max_num_batched_tokens=budget) == ref


def test_disaggregated_matches_transformers(gpt_oss):
    path, ref = gpt_oss
    assert generate(path, num_kv_blocks=64, expert_workers=1, micro_batches=2, backend="triton") == ref


def test_decode_half_compiles_whole_with_the_kernels(tiny_mixtral):
    """Where decode steps are not captured (``enforce_eager``; an attention worker), ``compile=True``
    compiles the attention half of decode steps with fullgraph=True over the custom ops (paged
    attention, the norms, RoPE with the cache write): float32 greedy tokens as transformers', no
    graph break, and decode steps whose batch shrinks from 4 to 1 (sequences finishing at different
    steps) served by two graphs (dynamo specializes batch 1: the second)."""
    ps = prompts()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 8, 20, 30)]
    ref = [r[:p.max_tokens] for r, p in zip(hf_greedy(tiny_mixtral, ps, 40), params)]

    def uncaptured(llm):
        assert llm.engine.engine.runner.captured is None

    got, counters = compiled_generate(tiny_mixtral, ps, params, uncaptured, num_kv_blocks=64, backend="triton",
                                      compile=True, enforce_eager=True)
    assert got == ref
    assert counters["stats"]["unique_graphs"] == 2, counters["stats"]
    assert not counters.get("graph_break"), counters.get("graph_break")
