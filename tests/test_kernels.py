"""The C++ CPU kernels against PyTorch references: fused MoE, paged attention (varlen, windows,
sinks, released blocks), RMS norm and RoPE with the cache write (bit for bit as the PyTorch code
they replace, in 16-bit types); the build's fallback when they cannot be had."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from afdserve.backends import cpu as kernels
from afdserve.backends.cpu import build
from afdserve.backends.pytorch.norm import apply_rotary, rms_norm as torch_rms_norm
from afdserve.model.rope import Rope

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {build.load().reason}")


def needs(kernel: str, dtype: torch.dtype = torch.float32) -> None:
    """Skips unless ``kernel`` runs for ``dtype`` here (a CPU with AVX2 but not AVX-512 builds some)."""
    if not kernels.supports(kernel, dtype):
        pytest.skip(f"no {kernel} kernel for {dtype} on this CPU")
DTYPES = [torch.float32, torch.bfloat16]


def _moe_reference(x, w1, w2, ids, w, local, act, b1, b2):
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w1.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            g = int(ids[t, j])
            if g >= local.numel() or local[g] < 0:
                continue
            e = int(local[g])
            gu = x[t].double() @ w1[e].double().T + (0 if b1 is None else b1[e].double())
            gate, up = gu[:inter], gu[inter:]
            if act == "silu":
                a = F.silu(gate) * up
            else:
                gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
                a = (up + 1) * gate * torch.sigmoid(gate * 1.702)
            out[t] += float(w[t, j]) * (a @ w2[e].double().T + (0 if b2 is None else b2[e].double()))
    return out


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden,inter,experts,k", [(1, 64, 32, 4, 2), (5, 64, 48, 8, 2), (37, 96, 40, 3, 3),
                                                           (80, 128, 64, 8, 2), (9, 6, 4, 2, 1)])
@pytest.mark.parametrize("act", ["silu", "swiglu_oai"])
def test_fused_moe_matches_the_reference(dtype, tokens, hidden, inter, experts, k, act):
    needs("fused_moe", dtype)
    from afdserve.backends.cpu.ops import fused_moe, pack_down, pack_gate_up

    g = torch.Generator().manual_seed(tokens * 7 + hidden)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w1 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(dtype)
    bias = act == "swiglu_oai"
    b1 = torch.randn(experts, 2 * inter, generator=g) * 0.1 if bias else None
    b2 = torch.randn(experts, hidden, generator=g) * 0.1 if bias else None
    # ids beyond the held experts (other workers') and one mapped to -1 contribute nothing
    ids = torch.stack([torch.randperm(experts + 2, generator=g)[:k] for _ in range(tokens)])
    local = torch.full((experts + 3,), -1, dtype=torch.int64)
    local[: experts - 1] = torch.arange(experts - 1)  # the last expert is not held here
    w = torch.softmax(torch.randn(tokens, k, generator=g), -1)
    want = _moe_reference(x, w1, w2, ids, w, local, act, b1, b2)
    for id_dtype in (torch.int64, torch.int32):
        got = fused_moe(x, pack_gate_up(w1), pack_down(w2), ids.to(id_dtype), w, local, inter, b1, b2, act).double()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (got - want).abs().max() <= tol * max(1.0, want.abs().max()), (id_dtype, (got - want).abs().max())
        # counts: every pair's id below its length added (the largest id is left out of the shorter one)
        for n in (experts + 2, experts + 1):
            counts = torch.full((n,), 3, dtype=torch.int64)
            again = fused_moe(x, pack_gate_up(w1), pack_down(w2), ids.to(id_dtype), w, local, inter, b1, b2, act,
                              counts=counts).double()
            assert torch.equal(again, got)
            assert torch.equal(counts, 3 + torch.bincount(ids.reshape(-1), minlength=experts + 2)[:n]), n


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_gives_a_pair_its_bits_whatever_the_rows_beside_it(dtype):
    """An expert's pairs are packed in groups (spread evenly, up to 12 rows each): every count of
    rows gives each token exactly what it gets alone, so a lane of 32 tokens and a batch of 64 agree."""
    needs("fused_moe", dtype)
    from afdserve.backends.cpu.ops import fused_moe, pack_down, pack_gate_up

    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 64, generator=g).to(dtype)
    w13 = pack_gate_up((torch.randn(3, 64, 64, generator=g) * 0.1).to(dtype))
    w2 = pack_down((torch.randn(3, 64, 32, generator=g) * 0.1).to(dtype))
    ids = torch.stack([torch.tensor([0, 1 + t % 2]) for t in range(40)])  # expert 0 has every token
    w = torch.softmax(torch.randn(40, 2, generator=g), -1)
    local = torch.arange(3)
    alone = torch.cat([fused_moe(x[t:t + 1], w13, w2, ids[t:t + 1], w[t:t + 1], local, 32) for t in range(40)])
    for rows in range(1, 41):
        assert torch.equal(fused_moe(x[:rows], w13, w2, ids[:rows], w[:rows], local, 32), alone[:rows]), rows


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_reads_no_scratch_it_did_not_write(dtype):
    """The kernel's packed activations are not zeroed (every unit of a real row is written before it
    is read): with memory the allocator hands back full of NaNs, results stay the reference's."""
    needs("fused_moe", dtype)
    from afdserve.backends.cpu.ops import fused_moe, pack_down, pack_gate_up

    g = torch.Generator().manual_seed(11)
    tokens, hidden, inter, experts = 70, 96, 40, 5  # groups of uneven rows; inter not a multiple of 16
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w1 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, 2, generator=g), -1)
    local = torch.arange(experts)
    want = fused_moe(x, pack_gate_up(w1), pack_down(w2), ids, w, local, inter)
    assert torch.isfinite(want.float()).all()
    w13, w2p = pack_gate_up(w1), pack_down(w2)
    for size in (1 << 12, 1 << 15, 1 << 18):  # freed NaN blocks of the sizes the kernel's buffers take
        poison = [torch.full((size,), float("nan")) for _ in range(4)]
        del poison
        assert torch.equal(fused_moe(x, w13, w2p, ids, w, local, inter), want), size


def _attention_reference(q, kc, vc, tables, kv_lens, cu_q, bs, window, scale, sinks):
    out = torch.zeros(q.shape, dtype=torch.float64)
    nh, nkv = q.shape[1], kc.shape[1]
    for s in range(len(kv_lens)):
        n, q0, q1 = int(kv_lens[s]), int(cu_q[s]), int(cu_q[s + 1])
        pos = torch.arange(n)
        slots = tables[s][pos // bs].long() * bs + pos % bs
        for t in range(q0, q1):
            p = n - (q1 - q0) + (t - q0)
            lo = max(0, p - window + 1) if window else 0
            ks, vs = kc[slots[lo : p + 1]].double(), vc[slots[lo : p + 1]].double()
            for h in range(nh):
                sc = (ks[:, h // (nh // nkv)] @ q[t, h].double()) * scale
                if sinks is not None:
                    sc = torch.cat([sc, sinks[h : h + 1].double()])
                pr = torch.softmax(sc, 0)[: ks.shape[0]]
                out[t, h] = pr @ vs[:, h // (nh // nkv)]
    return out


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("nh,nkv,hd,bs,window,sink", [(8, 2, 32, 16, 0, False), (4, 4, 16, 4, 0, False),
                                                     (8, 1, 64, 16, 5, True), (32, 2, 24, 8, 0, True),
                                                     (6, 3, 128, 16, 20, False), (2, 2, 40, 16, 0, False)])
def test_paged_attention_matches_the_reference(dtype, nh, nkv, hd, bs, window, sink):
    """Decodes and prefill pieces (a whole prompt, a chunk after a cached prefix) in one call, blocks
    scattered through the cache; a windowed sequence's blocks before its window are given back (-1)."""
    needs("paged_attention", dtype)
    from afdserve.backends.cpu.ops import paged_attention

    g = torch.Generator().manual_seed(nh * hd + bs)
    nblocks = 64
    kc = torch.randn(nblocks * bs, nkv, hd, generator=g).to(dtype)
    vc = torch.randn(nblocks * bs, nkv, hd, generator=g).to(dtype)
    qlens, kv_lens = [1, 7, 1, 20, 3, 40], [5, 7, 40, 33, 60, 40]
    tables = torch.full((len(qlens), max(-(-n // bs) for n in kv_lens)), -1, dtype=torch.int32)
    perm, i = torch.randperm(nblocks, generator=g), 0
    for s, n in enumerate(kv_lens):
        nb = -(-n // bs)
        tables[s, :nb] = perm[i : i + nb].int()
        i += nb
        if window:  # blocks wholly before every query's window are gone
            first = max(0, n - qlens[s] - window + 1)
            tables[s, : first // bs] = -1
    cu_q = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), nh, hd, generator=g).to(dtype)
    sinks = torch.randn(nh, generator=g) if sink else None
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    got = paged_attention(q, kc, vc, tables, lens, cu_q, bs, window, hd**-0.5, sinks)
    want = _attention_reference(q, kc, vc, tables.clamp_min(0), lens, cu_q, bs, window, hd**-0.5, sinks)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    assert (got.double() - want).abs().max() <= tol


@needs_kernels
def test_paged_attention_refuses_bad_metadata():
    needs("paged_attention")
    from afdserve.backends.cpu.ops import paged_attention

    kc = torch.zeros(64, 2, 16)
    q = torch.zeros(3, 4, 16)
    ok = dict(block_tables=torch.zeros(1, 1, dtype=torch.int32), kv_lens=torch.tensor([3], dtype=torch.int32),
              cu_q=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="more queries or keys"):
        paged_attention(q, kc, kc, ok["block_tables"], torch.tensor([20], dtype=torch.int32), ok["cu_q"], 16, 0, 1.0)
    with pytest.raises(RuntimeError, match="int32"):
        paged_attention(q, kc, kc, ok["block_tables"].long(), ok["kv_lens"], ok["cu_q"], 16, 0, 1.0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dim", [256, 64, 40, 6])
def test_rms_norm_is_the_modules(dtype, dim):
    """Bit for bit as the PyTorch RMSNorm in 16-bit types; float32 within an ulp (the sum's order)."""
    needs("rms_norm", dtype)
    from afdserve.backends.cpu.ops import add_rms_norm, rms_norm

    g = torch.Generator().manual_seed(dim)
    weight = (torch.randn(dim, generator=g) * 0.2 + 1).to(dtype)
    x, r = torch.randn(7, dim, generator=g).to(dtype), torch.randn(7, dim, generator=g).to(dtype)
    with torch.inference_mode():  # the torch backend's arithmetic
        h = x + r
        expect = torch_rms_norm(h, weight, 1e-5)
        got_h, got_y = add_rms_norm(x, r, weight, 1e-5)
        assert torch.equal(got_h, h)
        if dtype == torch.float32:
            assert torch.allclose(got_y, expect, rtol=1e-6, atol=1e-6)
            assert torch.allclose(rms_norm(h, weight, 1e-5), expect, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got_y, expect) and torch.equal(rms_norm(h, weight, 1e-5), expect)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("nh,nkv,d,rot,qk_norm", [(8, 2, 32, 32, False), (4, 2, 64, 32, True), (6, 3, 40, 40, False)])
def test_rope_cache_is_the_modules(dtype, nh, nkv, d, rot, qk_norm):
    """Queries as apply_rotary gives them, keys and values written at their slots (partial rotary,
    Qwen3's q/k norms); bit for bit without the norms (float32 too), within an ulp with them."""
    needs("rope_cache", dtype)
    from afdserve.backends.cpu.ops import rope_cache

    g = torch.Generator().manual_seed(nh * d + rot)
    t = 5
    cos, sin = Rope.from_config({"rope_theta": 1e4}, rot, 512).cos_sin(torch.tensor([3, 0, 17, 4, 100]), dtype)
    qkv = torch.randn(t, (nh + 2 * nkv) * d, generator=g).to(dtype)
    kc, vc = torch.zeros(64, nkv, d, dtype=dtype), torch.zeros(64, nkv, d, dtype=dtype)
    slots = torch.tensor([5, 9, 33, 2, 60])
    norms = [(torch.randn(d, generator=g) * 0.2 + 1).to(dtype) for _ in range(2)]
    with torch.inference_mode():
        q = rope_cache(qkv, cos, sin, kc, vc, slots, nh, nkv, *(norms if qk_norm else (None, None)), 1e-6)
        rq, rk, rv = qkv.split([nh * d, nkv * d, nkv * d], -1)
        rq, rk, rv = rq.view(t, nh, d), rk.reshape(t, nkv, d), rv.reshape(t, nkv, d)
        if qk_norm:
            rq, rk = torch_rms_norm(rq, norms[0], 1e-6), torch_rms_norm(rk, norms[1], 1e-6)
        rq, rk = apply_rotary(rq, cos, sin), apply_rotary(rk, cos, sin)
    assert torch.equal(vc[slots], rv)
    if qk_norm and dtype == torch.float32:
        assert torch.allclose(q, rq, atol=1e-5) and torch.allclose(kc[slots], rk, atol=1e-5)
    else:
        assert torch.equal(q, rq) and torch.equal(kc[slots], rk)


def test_switched_off_kernels_leave_the_pytorch_paths():
    code = ("from afdserve.backends import cpu as kernels; from afdserve.backends.cpu.build import load; import torch; "
            "print(kernels.available(), kernels.supports('fused_moe', torch.float32), load().reason)")
    env = {**os.environ, "AFDSERVE_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split()[:2] == ["False", "False"] and "AFDSERVE_KERNELS=0" in out


def test_a_failed_build_warns_and_leaves_the_pytorch_paths(tmp_path):
    """No compiler: the kernels are unavailable with the reason, a warning says so, nothing raises."""
    code = ("import warnings, torch; from afdserve.backends.cpu import build, supports\n"
            "def broken(d): raise RuntimeError('no compiler here')\n"
            "build._compile = broken\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    s = build.load()\n"
            "print(s.ok, supports('paged_attention', torch.float32), 'no compiler here' in s.reason, len(w))")
    env = {**os.environ, "AFDSERVE_CACHE": str(tmp_path)}  # nothing built there
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "True", "1"]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k,bias", [(1, 3000, 256, False), (8, 384, 256, True), (37, 100, 64, True),
                                          (300, 256, 256, False), (5, 7, 6, True)])
def test_linear_matches_the_reference(dtype, rows, n, k, bias):
    """Any N (padded to whole column blocks), float32 outputs from bfloat16 inputs on request."""
    needs("linear", dtype)
    from afdserve.backends.cpu.ops import linear, pack

    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    for out_dtype in (None, torch.float32):
        got = linear(x, pack(w), n, b, out_dtype)
        assert got.shape == (rows, n) and got.dtype == (out_dtype or dtype)
        exact = dtype == torch.float32 or out_dtype == torch.float32
        assert (got.double() - want).abs().max() <= (1e-5 if exact else 1e-2) * max(1.0, want.abs().max())


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_takes_any_number_of_rows(dtype):
    """Every row count of a group and past it (rows spread evenly over groups of up to 12; the tiles
    take them whole, or in fours, threes, twos and ones) gives each row the result it gets alone."""
    needs("linear", dtype)
    from afdserve.backends.cpu.ops import linear, pack

    g = torch.Generator().manual_seed(11)
    x = torch.randn(40, 96, generator=g).to(dtype)
    w = pack((torch.randn(70, 96, generator=g) * 0.1).to(dtype))
    alone = torch.cat([linear(x[i:i + 1], w, 70, None, torch.float32) for i in range(40)])
    for rows in range(1, 41):
        assert torch.equal(linear(x[:rows], w, 70, None, torch.float32), alone[:rows]), rows


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 13, 40])
def test_linear_argmax_is_torch_argmax_of_the_logits(dtype, rows):
    """The greedy LM head: each row's largest output and its index plus the offset, without the
    outputs written, is ``torch.argmax`` of what ``linear`` writes (the first of equal maxima, the
    first NaN), over any number of columns (a ragged last block), with a bias, in chunks of blocks
    that threads merge in any order."""
    needs("linear", dtype)
    from afdserve.backends.cpu.ops import linear, linear_argmax, pack

    g = torch.Generator().manual_seed(13)
    x = torch.randn(rows, 512, generator=g).to(dtype)  # 40 rows: chunks of 3 blocks (parallel_lent)
    w = (torch.randn(3000, 512, generator=g) * 0.1).to(dtype)
    w[2900] = w[1500] = w[33] * 4  # ties: the same largest logit in blocks far apart, and in one block
    w[35] = w[33] * 4
    bias = torch.randn(2999, generator=g)
    for n, b in ((3000, None), (2999, bias), (31, None), (32, None), (1, None)):
        packed = pack(w[:n])
        want = linear(x, packed, n, b, torch.float32)
        val, idx = linear_argmax(x, packed, n, 7, b)
        assert torch.equal(idx, torch.argmax(want, dim=-1) + 7), n
        assert torch.equal(val, want.max(dim=-1).values), n
    packed = pack(w)
    want = torch.argmax(linear(x, packed, 3000, None, torch.float32), dim=-1)
    for order in ([(0, 1024), (1024, 2048), (2048, 3000)], [(2048, 3000), (0, 1024), (1024, 2048)]):
        into = (torch.zeros(rows), torch.full((rows,), -1, dtype=torch.int64))  # pieces merged in place, any order
        for a, e in order:
            linear_argmax(x, pack(w[a:e]), e - a, a, into=into)
        assert torch.equal(into[1], want), order
    w[1700, 3] = w[2500, 5] = float("nan")  # NaN logits in every row: the first one is the choice
    packed = pack(w)
    want = linear(x, packed, 3000, None, torch.float32)
    val, idx = linear_argmax(x, packed, 3000)
    assert torch.equal(idx, torch.argmax(want, dim=-1)) and (idx == 1700).all() and val.isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_big_logits_written_past_the_caches_keep_their_bits(dtype):
    """Logits of 2 MiB or more (``stream``: the LM head's) are written with streaming stores where a
    block is aligned (rows of 8,030 floats: some are, some are not), with plain stores elsewhere and
    for the ragged last block: the bits of the plain-stored call."""
    needs("linear", dtype)
    from afdserve.backends.cpu.ops import linear, pack

    g = torch.Generator().manual_seed(5)
    x = torch.randn(136, 64, generator=g).to(dtype)
    w = pack((torch.randn(8030, 64, generator=g) * 0.1).to(dtype))
    plain = linear(x, w, 8030, None, torch.float32)
    streamed = linear(x, w, 8030, None, torch.float32, stream=True)
    assert streamed.nbytes >= 2 << 20 and torch.equal(streamed, plain)


def test_a_build_killed_midway_does_not_hold_up_the_next(tmp_path):
    """The extension builder's lock file, left by a killed build, is removed by the next build (which
    holds afdserve's own lock), not waited on forever."""
    code = ("import torch; from afdserve.backends.cpu import build\n"
            "d = build.build_dir(); d.mkdir(parents=True); (d / 'lock').touch()\n"
            "seen = []\n"
            "def fake(directory): seen.append((directory / 'lock').exists()); raise RuntimeError('built')\n"
            "build._build = fake\n"
            "s = build.load()\n"
            "print(seen, 'built' in s.reason)")
    env = {**os.environ, "AFDSERVE_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.split() == ["[False]", "True"]


@needs_kernels
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fused_attention_half_is_the_layer_call_by_call(arch, dtype, tmp_path):
    """``attention_half`` (the cpu attention backend: one call a layer) gives the bits of its kernels
    called one by one: h, y, the router's logits and the caches, for decodes and prefill pieces in
    one batch; with QKV biases (Qwen2-MoE), q/k norms (Qwen3-MoE), sinks, output biases, windows and
    a biased router (gpt-oss, whose router's logits are computed apart)."""
    needs("attention_half", dtype)
    sys.path.insert(0, os.path.dirname(__file__))
    from tiny_models import make_checkpoint, make_gpt_oss_checkpoint

    from afdserve.backends import choose
    from afdserve.backends.cpu.ops import add_rms_norm, linear, paged_attention, rms_norm, rope_cache
    from afdserve.backends.step import StepLayout
    from afdserve.kvcache.cache import KVCache
    from afdserve.model.model import AttentionModel

    path = make_gpt_oss_checkpoint(tmp_path / "m") if arch == "gpt_oss" else make_checkpoint(tmp_path / "m", arch)
    model = AttentionModel.load(path, dtype).prepare(choose("cpu", dtype, "cpu"))
    cfg, bs = model.cfg, 4
    qlens, kv_lens = [1, 6, 1, 1, 3], [9, 6, 20, 2, 13]
    g = torch.Generator().manual_seed(0)
    perm, tables, i = torch.randperm(40, generator=g).tolist(), [], 0
    for n in kv_lens:
        tables.append(perm[i: i + -(-n // bs)])
        i += len(tables[-1])
    from afdserve.backends.step import StepBuffers

    ctx = model.context(StepLayout.from_blocks(qlens, kv_lens, tables, bs), StepBuffers("cpu"))
    x = torch.randn(sum(qlens), cfg.hidden_size, generator=g).to(dtype)

    def one_by_one(a, router, k, v):
        qkv, o_p = a.qkv.op, a.o_proj.op
        xn = rms_norm(x, a.input_norm.weight, a.eps)
        norms = (None, None) if a.q_norm is None else (a.q_norm.weight, a.k_norm.weight)
        q = rope_cache(linear(xn, qkv.packed, qkv.out_features, qkv.bias), ctx.cos, ctx.sin, k, v, ctx.slot_mapping,
                       a.num_heads, a.num_kv_heads, *norms, a.eps)
        sinks = None if a.sinks is None else a.sinks.float()
        att = paged_attention(q, k, v, ctx.block_tables, ctx.kv_lens, ctx.cu_q, bs, a.window, a.scale, sinks)
        h, y = add_rms_norm(linear(att.view(x.shape[0], -1), o_p.packed, o_p.out_features, o_p.bias), x,
                            a.post_norm.weight, a.eps)
        return h, y, None if router is None else linear(y, router.packed, router.out_features).float()

    def caches():
        kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 40, bs, dtype)
        kv.k.normal_(generator=torch.Generator().manual_seed(1))
        kv.v.normal_(generator=torch.Generator().manual_seed(2))
        return kv

    fused_kv, ref_kv = caches(), caches()
    for layer, a in enumerate(model.attn):
        assert type(a.half).__name__ == "FusedHalf"
        router = a.half.router
        assert (router is None) == (arch == "gpt_oss")  # the biased router's logits are not fused
        got = a(x, ctx, fused_kv.keys(layer), fused_kv.values(layer))
        want = one_by_one(a, router, ref_kv.keys(layer), ref_kv.values(layer))
        for g_, w_ in zip(got, want):
            assert (g_ is None and w_ is None) or torch.equal(g_, w_)
    assert torch.equal(fused_kv.k, ref_kv.k) and torch.equal(fused_kv.v, ref_kv.v)
