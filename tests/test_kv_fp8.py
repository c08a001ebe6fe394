"""The FP8 KV cache (``kv_cache_dtype="fp8_e4m3"``, afdserve.kvcache.fp8): the write path never
saturates (a block re-scaled when a later token is larger, a reused block starting afresh); the
logprobs of tiny checkpoints of every attention kind stay within a bound of the float32-KV run on
every backend; the prefix cache's tiers keep FP8 blocks and their scales bit-exactly, apart from
other KV dtypes; bad values are refused clearly."""

import random
import subprocess
import sys

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.backends import choose
from afdserve.backends.step import StepBuffers
from afdserve.config import EngineConfig
from afdserve.engine.builder import prefix_config
from afdserve.errors import ConfigError
from afdserve.kvcache.block_manager import BlockManager
from afdserve.kvcache.cache import KVCache
from afdserve.kvcache.fp8 import FP8, FP8_MAX, Fp8Pages, dequantize, write
from afdserve.kvcache.prefix import PrefixCacheConfig, block_hashes
from tiny_models import make_checkpoint

BS = 4


def _pages(num_blocks=3, heads=2, d=8, bs=BS):
    return Fp8Pages(torch.zeros(num_blocks * bs, heads, d, dtype=FP8), torch.zeros(num_blocks, heads), bs)


def _write(pages, slots, x, first_rows=(0,)):
    write(pages, torch.tensor(slots), x, torch.tensor(first_rows))


def test_a_later_token_100x_larger_rescales_its_block():
    pages, g = _pages(), torch.Generator().manual_seed(0)
    small = torch.randn(2, 2, 8, generator=g)
    big = 100 * torch.randn(1, 2, 8, generator=g)
    _write(pages, [4, 5], small)  # block 1, offsets 0 and 1 (one step)
    before = pages.scale[1].clone()
    _write(pages, [6], big)  # a later step: offset 2, 100x larger
    assert torch.equal(pages.scale[1], torch.maximum(before, big.abs().amax(-1)[0] / FP8_MAX))
    assert not pages.data.float().isnan().any()
    got = dequantize(pages, torch.tensor([4, 5, 6]), torch.float32)
    # e4m3 keeps 3 mantissa bits: a value is within 2^-4 of its magnitude (twice: re-quantized), or
    # under the block's smallest normal step (values 100x below the block's scale lose their bits)
    want = torch.cat([small, big])
    step = pages.scale[1][None, :, None] * 2.0**-6
    assert ((got - want).abs() <= want.abs() * 2 * 2.0**-4 + step).all()
    assert torch.allclose(got[2], big[0], rtol=2.0**-4)  # the large token: exact to e4m3's precision
    assert (got[:2].abs() > 0).sum() > 0.5 * small.numel()  # the small ones survive, coarser


def test_a_block_reused_starts_afresh_and_others_are_untouched():
    pages = _pages()
    _write(pages, [0, 1, 2, 3, 4], torch.full((5, 2, 8), 300.0))
    kept = pages.data[4:8].clone(), pages.scale[1].clone()
    _write(pages, [0, 1], torch.full((2, 2, 8), 0.5))  # block 0 freed and reused: its first slot written
    assert torch.allclose(pages.scale[0], torch.full((2,), 0.5 / FP8_MAX))
    assert torch.equal(dequantize(pages, torch.tensor([0, 1]), torch.float32), torch.full((2, 2, 8), 0.5))
    assert torch.equal(pages.data[4:8].view(torch.uint8), kept[0].view(torch.uint8))
    assert torch.equal(pages.scale[1], kept[1])


def test_two_sequences_in_one_step_and_the_latent_layout():
    pages = _pages()
    _write(pages, [1], torch.ones(1, 2, 8))
    # one step: sequence 0 continues block 0 (offset 2, 10x larger), sequence 1 starts block 2
    _write(pages, [2, 8, 9], torch.stack([torch.full((2, 8), 10.0), torch.ones(2, 8), -torch.ones(2, 8)]),
           first_rows=(0, 1))
    got = dequantize(pages, torch.tensor([1, 2, 8, 9]), torch.float32)
    assert torch.allclose(got, torch.stack([torch.ones(2, 8), torch.full((2, 8), 10.0), torch.ones(2, 8),
                                            -torch.ones(2, 8)]), rtol=2.0**-3)
    lat = Fp8Pages(torch.zeros(8, 6, dtype=FP8), torch.zeros(2, 1), BS)  # MLA: [slots, D], a scale per block
    x = torch.randn(3, 6)
    write(lat, torch.tensor([0, 1, 2]), x, torch.tensor([0]))
    assert torch.allclose(dequantize(lat, torch.tensor([0, 1, 2]), torch.float32), x, rtol=2.0**-4, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,window,sinks", [(4, 4, 16, 0, False), (8, 2, 24, 7, True)])
def test_the_triton_kernel_reads_fp8_as_the_torch_backend(dtype, heads, kv_heads, head_dim, window, sinks):
    from test_triton_attention import _batch

    triton_attn = choose("cpu", dtype, "torch", attention="triton", fp8_kv=True).attention
    ref = choose("cpu", dtype, "torch", fp8_kv=True).attention
    for seed in range(2):
        block_size = (4, 16)[seed]
        layout, n_blocks, _ = _batch(seed + 10 * heads + window, block_size, window)
        g = torch.Generator().manual_seed(seed)
        k, v = (Fp8Pages((torch.randn(n_blocks * block_size, kv_heads, head_dim, generator=g) * 100).to(FP8),
                         torch.rand(n_blocks, kv_heads, generator=g) / 64, block_size) for _ in range(2))
        q = torch.randn(layout.num_tokens, heads, head_dim, generator=g).to(dtype)
        sink = torch.randn(heads, generator=g) if sinks else None
        want = ref.attend(q, k, v, ref.prepare(layout, (window,), StepBuffers("cpu")), window, sink, 0.3)
        got = triton_attn.attend(q, k, v, triton_attn.prepare(layout, (window,), StepBuffers("cpu")), window, sink, 0.3)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


# -- tiny checkpoints: logprobs against the float32-KV run --

def _run(path, backend, kv_dtype):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (50, 37, 9)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    # chunks of 24 tokens over blocks of 16: chunks end inside blocks, which the next one re-scales
    with LLM(str(path), dtype="float32", kv_cache_dtype=kv_dtype, backend=backend, block_size=16,
             num_kv_blocks=128, max_num_batched_tokens=24, max_model_len=256, enable_prefix_caching=False) as llm:
        return prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def _top1(position) -> int:
    return max(position.items(), key=lambda kv: kv[1].logprob)[0]


# per model: bounds on |logprob(fp8) - logprob(float32 KV)| of the prompts' tokens (prefill chunks
# read the cache back): the mean and the largest (where a perturbed router picks another expert,
# the token moves most); and the share of positions whose most likely next token is the same
# (teacher-forced greedy). Measured (mean, max, share), on each backend alike: mixtral 0.025, 0.17,
# 91%; qwen3_moe 0.038, 0.50, 94%; deepseek_v3 0.061, 0.72, 80%; gpt_oss 0.46, 3.6, 67% -- its
# keys carry large random biases (N(0, 0.5), weights N(0, 0.3)), so e4m3's relative rounding (2^-4
# at most) moves its scores most. The bounds leave about 1.5x of that.
BOUNDS = {"mixtral": (0.05, 0.35, 0.85), "qwen3_moe": (0.075, 1.0, 0.85), "deepseek_v3": (0.12, 1.5, 0.7),
          "gpt_oss": (0.7, 5.0, 0.55)}


# every backend on one model, every model on some backend ("auto": the C++ kernels' RoPE writes the
# step buffer the fp8 cache quantizes, attention on torch); DeepSeek's MLA runs on torch
@pytest.mark.parametrize("model,backend", [("mixtral", "torch"), ("mixtral", "auto"), ("mixtral", "triton"),
                                           ("qwen3_moe", "auto"), ("gpt_oss", "torch"), ("gpt_oss", "triton"),
                                           ("deepseek_v3", "torch")])
def test_logprobs_within_a_bound_of_the_float32_kv_run(four_archs, model, backend):
    prompts, ref = _run(four_archs[model], backend, "auto")
    _, got = _run(four_archs[model], backend, "fp8_e4m3")
    delta, same, scale = [], 0, 0.0
    for p, r, o in zip(prompts, ref, got):
        for j in range(1, len(p)):
            a, b = r.prompt_logprobs[j][p[j]].logprob, o.prompt_logprobs[j][p[j]].logprob
            delta.append(abs(a - b))
            scale = max(scale, abs(a))
            same += _top1(r.prompt_logprobs[j]) == _top1(o.prompt_logprobs[j])
        # the first generated token (the prefill's last position and a decode after it)
        t = r.outputs[0].token_ids[0]
        assert abs(r.outputs[0].logprobs[0][t].logprob - o.outputs[0].logprobs[0][t].logprob) <= BOUNDS[model][1]
    mean = sum(delta) / len(delta)
    print(f"{model}/{backend}: |d logprob| mean {mean:.4f} max {max(delta):.4f} (|logprob| up to {scale:.2f}); "
          f"top-1 equal {same}/{len(delta)}")
    mean_bound, max_bound, share = BOUNDS[model]
    assert mean <= mean_bound and max(delta) <= max_bound and mean < 0.05 * scale
    assert same >= share * len(delta)


def test_attention_workers_get_the_kv_dtype(four_archs):
    """A disaggregated deployment's attention worker builds the same FP8 cache: the same tokens."""
    prompts = [{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": list(range(50, 60))}]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = []
    for kv, workers in (("fp8", 0), ("fp8", 1), ("auto", 1)):
        with LLM(str(four_archs["mixtral"]), dtype="float32", kv_cache_dtype=kv, backend="torch", block_size=4,
                 num_kv_blocks=200, expert_workers=workers) as llm:
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1] != outs[2]  # (this checkpoint's near-ties tell the two caches apart)


def test_the_quality_report(four_archs):
    from afdserve.bench.kv_quality import kv_quality, report

    rows = {(r.reference, r.candidate): r for r in kv_quality(str(four_archs["qwen3_moe"]), 3, "torch",
                                                              ("a held-out sentence", "and another one here"))}
    fp8, bf16 = rows["float32", "fp8"], rows["float32", "bfloat16"]
    assert fp8.positions == bf16.positions == 6
    assert 0 < fp8.mean_kl <= fp8.max_kl < 0.05 and fp8.greedy_agreement >= 0.5
    assert 0 < bf16.mean_kl < 0.05 and "greedy agreement" in report(list(rows.values()))


# -- the prefix cache's tiers and salt --

@pytest.mark.parametrize("tier", ["host", "disk"])
def test_tiers_keep_fp8_blocks_and_scales_bit_exactly(tmp_path, tier):
    n, salt, g = 4, b"fp8-salt", torch.Generator().manual_seed(1)

    def manager():
        kv = KVCache(2, 2, 8, n, BS, FP8)
        cfg = (PrefixCacheConfig(salt, host_bytes=8 * kv.block_bytes) if tier == "host" else
               PrefixCacheConfig(salt, disk_dir=str(tmp_path), disk_bytes=10**6))
        return BlockManager(n, BS, cfg, kv), kv

    def compute(bm, kv, sid, tokens):
        keys = block_hashes(tokens, BS, salt)
        cached = bm.acquire(sid, bm.lookup(keys, (len(tokens) - 1) // BS), len(tokens))
        bm.reserve(sid, len(tokens))
        for b in bm.tables[sid][cached // BS:]:
            for part in kv.read_block(b):  # random bytes (never NaN's 0x7f / 0xff) and scales
                if part.dtype == FP8:
                    part.view(torch.uint8).copy_(torch.randint(0, 0x7F, part.shape, generator=g, dtype=torch.uint8))
                else:
                    part.copy_(torch.rand(part.shape, generator=g))
        bm.commit(sid, keys, len(tokens))
        return cached

    bm, kv = manager()
    a = list(range(10, 23))
    compute(bm, kv, 1, a)
    want = [tuple(p.clone() for p in kv.read_block(b)) for b in bm.tables[1][:3]]
    assert [p.dtype for p in want[0]] == [FP8, FP8, torch.float32, torch.float32]
    bm.free(1)
    if tier == "host":
        compute(bm, kv, 2, list(range(100, 116)))  # takes every block: a's spill to host memory
        bm.free(2)
    else:
        bm.persist()  # shutdown: every cached block to disk, then a restart
        bm, kv = manager()
    assert compute(bm, kv, 3, a) == 12
    assert getattr(bm.stats(), f"{tier}_hit_tokens") == 12
    for b, w in zip(bm.tables[3][:3], want):
        for got, exp in zip(kv.read_block(b), w):
            assert torch.equal(got.view(torch.uint8), exp.view(torch.uint8))


def test_the_salt_includes_the_kv_dtype(tmp_path):
    path = make_checkpoint(tmp_path / "m", "mixtral")
    salts = {kv: prefix_config(EngineConfig(model=str(path), dtype="bfloat16", kv_cache_dtype=kv), path).salt
             for kv in ("auto", "fp8_e4m3")}
    assert salts["auto"] != salts["fp8_e4m3"]
    assert prefix_config(EngineConfig(model=str(path), dtype="bfloat16", kv_cache_dtype="fp8"), path).salt == \
        salts["fp8_e4m3"]


# -- choices and bad values --

def test_backends_decide_once_and_bad_values_are_refused():
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp16x'.*fp8_e4m3"):
        EngineConfig(kv_cache_dtype="fp16x")
    b = choose("cpu", torch.float32, fp8_kv=True)
    assert b.attention.name == "torch" and b.attention.kv.quantized  # the cpu kernels read no fp8
    with pytest.raises(ConfigError, match="fp8"):
        choose("cpu", torch.float32, "cpu", fp8_kv=True)
    assert choose("cpu", torch.float32, attention="triton", fp8_kv=True).attention.kv.quantized
    assert not choose("cpu", torch.float32, "torch").attention.kv.quantized
    r = subprocess.run([sys.executable, "-m", "afdserve.cli.main", "generate", "--kv-cache-dtype", "fp16x",
                        "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--kv-cache-dtype" in r.stderr and "fp8_e4m3" in r.stderr
