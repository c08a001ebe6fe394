"""Context-parallel prefill's attention (``afdserve.backends.pytorch.ring``, ``cp_half``) and its
split (``afdserve.kvcache.cp_split.zigzag``): partial attentions over each rank's keys merged by
their log-sum-exps equal full causal attention (GQA, windows, sinks, MLA's latent form, queries
that see no key); the CP halves of real tiny layers, their ranks run in threads over an in-process
ring, equal the layers' normal prefill of the whole prompt, and the owner's cache (plain or FP8)
afterwards holds what the normal prefill writes."""

import dataclasses
import queue
import threading

import pytest
import torch
import torch.nn.functional as F

from afdserve.backends import choose
from afdserve.backends.pytorch import ring
from afdserve.backends.pytorch.cp_half import cp_attention, cp_latent
from afdserve.backends.pytorch.ring import RingAttention, cpu_partial, latent_partial, merge, partial
from afdserve.backends.step import AttnContext, CPContext, StepBuffers, StepLayout
from afdserve.kvcache.cache import KVCache
from afdserve.kvcache.cp_split import zigzag
from afdserve.kvcache.fp8 import FP8
from afdserve.model.mla import MLAPart
from afdserve.model.model import AttentionModel

TOL = dict(rtol=1e-5, atol=1e-5)
# the device-agnostic partial attention, and the CPU's fused one where torch has its kernel
ATTENDS = [partial, pytest.param(cpu_partial, marks=pytest.mark.skipif(
    RingAttention.on("cpu").partial is not cpu_partial, reason="no fused CPU flash-attention kernel in this torch"))]


# -- the split --

@pytest.mark.parametrize("n,N,bs", [(1, 1, 4), (7, 1, 4), (37, 3, 4), (64, 2, 16), (10, 2, 2), (5, 3, 4),
                                    (1000, 4, 16), (17, 8, 1)])
def test_zigzag_covers_the_prompt_in_block_aligned_pieces_the_owner_last(n, N, bs):
    pieces = zigzag(n, N, bs)
    assert len(pieces) == N
    flat = sorted(p for rank in pieces for p in rank)
    assert flat[0][0] == 0 and flat[-1][1] == n and all(a[1] == b[0] for a, b in zip(flat, flat[1:]))
    assert all(s % bs == 0 and e > s for s, e in flat)
    assert pieces[0][-1][1] == n  # the owner computes the last token
    assert all(list(rank) == sorted(rank) and len(rank) <= 2 for rank in pieces)
    c = -(-(-(-n // (2 * N))) // bs) * bs
    assert all(sum(e - s for s, e in rank) <= 2 * c for rank in pieces)


def test_zigzag_is_the_mirrored_pairs_of_2N_chunks():
    assert zigzag(64, 2, 16) == (((0, 16), (48, 64)), ((16, 32), (32, 48)))
    assert zigzag(60, 3, 8) == (((0, 16), (48, 60)), ((16, 32), (32, 48)), ())  # c = 16: 4 chunks
    assert zigzag(96, 3, 8) == (((0, 16), (80, 96)), ((16, 32), (64, 80)), ((32, 48), (48, 64)))
    assert zigzag(10, 2, 2) == (((0, 4), (8, 10)), ((4, 8),))
    assert zigzag(3, 2, 4) == (((0, 3),), ())


@pytest.mark.parametrize("args", [(0, 1, 4), (5, 0, 4), (5, 1, 0), (5.0, 1, 4), (5, True, 4), (5, 1, "4")])
def test_zigzag_refuses_bad_inputs(args):
    with pytest.raises(ValueError, match="zigzag"):
        zigzag(*args)


# -- partial + merge against full attention --

def _full(q, k, v, window, sinks, scale):
    """Causal attention over the whole sequence (positions 0..n-1), float32 SDPA; q [n, H, D],
    k/v [n, kvh, D]; sinks: a zero key whose logit is sinks[h], with a zero value."""
    n, h = q.shape[:2]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    seen = (j <= i) & ((i - j < window) if window else True)
    bias = torch.zeros(1, h, n, n).masked_fill(~seen, float("-inf"))
    ks, vs = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if sinks is not None:
        bias = torch.cat([bias, sinks.view(1, h, 1, 1).expand(1, h, n, 1)], dim=-1)
        ks, vs = F.pad(ks, (0, 0, 0, 1)), F.pad(vs, (0, 0, 0, 1))
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], ks, vs, attn_mask=bias, scale=scale,
                                       enable_gqa=True)
    return o[0].transpose(0, 1)


def _positions(pieces):
    return torch.cat([torch.arange(s, e) for s, e in pieces]) if pieces else torch.zeros(0, dtype=torch.long)


def _ring_merge(n, N, bs, attend, dtype=torch.float32):
    """Every rank's merged output (its queries over every rank's keys), scattered into [n, ...]."""
    split = [_positions(p) for p in zigzag(n, N, bs)]
    out = None
    for pos in split:
        if pos.numel() == 0:
            continue
        o = attend(pos, split)
        out = o.new_full((n, *o.shape[1:]), float("nan")) if out is None else out
        out[pos] = o
    return out


@pytest.mark.parametrize("attend", ATTENDS)
@pytest.mark.parametrize("N", [1, 2, 3])
@pytest.mark.parametrize("n", [37, 16])
@pytest.mark.parametrize("heads,kv_heads,window,with_sinks", [(4, 4, 0, False), (6, 2, 5, True), (4, 1, 0, True),
                                                              (2, 2, 9, False)])
def test_partials_merge_to_full_causal_attention(N, n, heads, kv_heads, window, with_sinks, attend):
    g = torch.Generator().manual_seed(n * 10 + N)
    q, k, v = (torch.randn(n, h, 8, generator=g) for h in (heads, kv_heads, kv_heads))
    sinks = torch.randn(heads, generator=g) if with_sinks else None

    def rank(pos, split):
        parts = [attend(q[pos], k[kp], v[kp], pos, kp, 0.3, window) for kp in split]
        return merge(parts, sinks, torch.float32)

    got = _ring_merge(n, N, 4, rank)
    torch.testing.assert_close(got, _full(q, k, v, window, sinks, 0.3), **TOL)


@pytest.mark.parametrize("fn", [partial, cpu_partial])
@pytest.mark.parametrize("N,n,window,block", [(2, 37, 0, 256), (3, 64, 0, 256), (2, 70, 5, 4), (3, 53, 9, 8),
                                              (1, 30, 3, 5), (2, 40, 64, 8)])
def test_blocks_attend_as_one_masked_partial(monkeypatch, fn, N, n, window, block):
    """``attend`` over the pieces (only the blocks that see each other, windows cut into blocks of
    queries over their window's keys) equals one masked ``partial`` of every query over every key,
    for each pair of ranks' pieces."""
    monkeypatch.setattr(ring, "WINDOW_BLOCK", block)
    g = torch.Generator().manual_seed(n + N + window)
    q, k, v = (torch.randn(n, h, 8, generator=g) for h in (6, 2, 2))
    pieces = zigzag(n, N, 4)
    for qr in range(N):
        for kr in range(N):
            qp, kp = _positions(pieces[qr]), _positions(pieces[kr])
            if not qp.numel() or not kp.numel():
                continue
            want = partial(q[qp], k[kp], v[kp], qp, kp, 0.3, window)
            got = ring.attend(fn, q[qp], k[kp], v[kp], qp, kp, pieces[qr], pieces[kr], 0.3, window)
            torch.testing.assert_close(got[1], want[1], **TOL)
            torch.testing.assert_close(got[0], want[0], **TOL)


@pytest.mark.parametrize("attend", ATTENDS)
@pytest.mark.parametrize("N", [1, 2, 3])
def test_latent_partials_merge_to_full_mla_attention(N, attend):
    n, heads, r, rope = 29, 5, 12, 6
    g = torch.Generator().manual_seed(N)
    q, lat = torch.randn(n, heads, r + rope, generator=g), torch.randn(n, r + rope, generator=g)

    def rank(pos, split):
        return merge([latent_partial(q[pos], lat[kp], pos, kp, 0.2, r, attend) for kp in split], None, torch.float32)

    want = _full(q, lat[:, None].expand(n, heads, r + rope), lat[:, None, :r].expand(n, heads, r), 0, None, 0.2)
    torch.testing.assert_close(_ring_merge(n, N, 4, rank), want, **TOL)


@pytest.mark.parametrize("partial", ATTENDS)
def test_a_query_that_sees_no_key_weighs_nothing(partial):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 8, generator=g), torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    q_pos, k_pos = torch.tensor([2, 6, 9]), torch.tensor([5, 6, 7, 8, 9])
    o, lse = partial(q, k, v, q_pos, k_pos, 0.5, window=3)
    assert torch.isneginf(lse[0]).all() and (o[0] == 0).all()
    assert torch.isfinite(lse[1:]).all()
    # merged alone: zeros, no NaN; with sinks: still zeros (a sink has no value)
    assert (merge([(o, lse)], None, torch.float32)[0] == 0).all()
    assert (merge([(o, lse)], torch.randn(4, generator=g), torch.float32)[0] == 0).all()
    # merged with a partial that sees keys: that partial's output
    o2, lse2 = partial(q, k[:1], v[:1], q_pos, torch.tensor([0]), 0.5)
    torch.testing.assert_close(merge([(o, lse), (o2, lse2)], None, torch.float32)[0], o2[0], **TOL)
    # no keys at all
    o3, lse3 = partial(q, k[:0], v[:0], q_pos, k_pos[:0], 0.5)
    assert torch.isneginf(lse3).all() and (o3 == 0).all()


@pytest.mark.parametrize("partial", ATTENDS)
def test_queries_in_chunks_give_the_same_result(monkeypatch, partial):
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(23, 4, 8, generator=g), torch.randn(23, 2, 8, generator=g), torch.randn(23, 2, 8, generator=g)
    pos = torch.arange(23)
    whole = partial(q, k, v, pos, pos, 0.4, 6)
    monkeypatch.setattr(ring, "SCORE_BYTES", 4 * 4 * 23 * 5)  # 5 queries a chunk (10: the fused one's)
    for a, b in zip(partial(q, k, v, pos, pos, 0.4, 6), whole):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("partial", ATTENDS)
def test_partial_refuses_heads_that_do_not_group(partial):
    with pytest.raises(ValueError, match="multiple"):
        partial(torch.zeros(1, 3, 4), torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), torch.zeros(1, dtype=torch.long),
                torch.zeros(1, dtype=torch.long), 1.0)


# -- the CP halves of real tiny layers over an in-process ring --

BS, BLOCKS = 4, 24


class _Ring:
    """Rank ``rank`` of an in-process ring of ``len(inboxes)`` ranks: ``send`` puts into the next
    rank's inbox; ``receive`` takes the N - 1 other ranks' KV from its own and forwards each to the
    next rank unless it is the one that sent it."""

    def __init__(self, inboxes: list[queue.Queue], rank: int):
        self.inboxes, self.rank = inboxes, rank
        self.next = (rank + 1) % len(inboxes)

    def send(self, layer, parts, positions):
        self.inboxes[self.next].put((layer, self.rank, parts, positions))

    def receive(self, layer):
        for _ in range(len(self.inboxes) - 1):
            got_layer, origin, parts, positions = self.inboxes[self.rank].get(timeout=30)
            assert got_layer == layer
            if origin != self.next:
                self.inboxes[self.next].put((got_layer, origin, parts, positions))
            yield origin, parts, positions


def _model(path, backend: str, fp8: bool) -> AttentionModel:
    model = AttentionModel.load(path, "float32")
    return model.prepare(choose("cpu", torch.float32, backend, latent=model.cfg.mla is not None, fp8_kv=fp8))


def _cache(cfg, dtype) -> KVCache:
    return KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCKS, BS, dtype, cfg.kv_latent_dim)


def _layer(model, l, x, ctx, kv):
    part = model.attn[l]
    if isinstance(part, MLAPart):
        return (*part(x, ctx, kv.latent(l)), None)
    return part(x, ctx, kv.keys(l), kv.values(l))


def _prefill(model, x, table, kv):
    """The normal prefill of the whole prompt, every layer on the same input x: its (h, y, logits)."""
    n = x.shape[0]
    ctx = model.context(StepLayout.from_blocks([n], [n], [table], BS), StepBuffers("cpu"))
    return [_layer(model, l, x, ctx, kv) for l in range(model.cfg.num_layers)]


def _cp(model, x, table, N, kv_dtype, attention):
    """Each rank's CP halves in a thread over an in-process ring: per rank (positions, its layers'
    results, its cache)."""
    pieces = zigzag(x.shape[0], N, BS)
    positions = [_positions(p) for p in pieces]
    blocks = torch.tensor(table)
    slots = [blocks[p // BS] * BS + p % BS for p in positions]
    inboxes = [queue.Queue() for _ in range(N)]
    caches, results, errors, ctxs = [_cache(model.cfg, kv_dtype) for _ in range(N)], [None] * N, [], []
    for r, own in enumerate(pieces):
        layout = StepLayout.from_blocks([e - s for s, e in own], [e for _, e in own], [table] * len(own), BS)
        base = model.context(layout, StepBuffers("cpu"))
        assert torch.equal(base.positions, positions[r])
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(AttnContext)}
        ctxs.append(CPContext(**fields, ring=_Ring(inboxes, r), owner=r == 0,
                              rank_slots={s: slots[s] for s in range(1, N)} if r == 0 else {}, attention=attention,
                              pieces=pieces, rank=r))

    def run(r):
        try:
            out, kv = [], caches[r]
            for l, part in enumerate(model.attn):
                if isinstance(part, MLAPart):
                    out.append((*cp_latent(part, l, x[positions[r]], ctxs[r], kv.latent(l)), None))
                else:
                    out.append(cp_attention(part, l, x[positions[r]], ctxs[r], kv.keys(l), kv.values(l)))
            results[r] = out
        except BaseException as e:  # noqa: BLE001 -- re-raised by the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return positions, results, caches


# fused: the CPU's partial attention (RingAttention.on("cpu")), else the context names none (portable)
@pytest.mark.parametrize("arch,backend,N,fp8,fused", [
    ("mixtral", "torch", 2, False, False), ("mixtral", "auto", 3, False, True), ("qwen3_moe", "torch", 3, False, True),
    ("gpt_oss", "torch", 3, False, True), ("gpt_oss", "torch", 3, False, False), ("gpt_oss", "torch", 1, False, True),
    ("deepseek_v3", "torch", 3, False, True), ("deepseek_v3", "torch", 3, False, False),
    ("mixtral", "torch", 3, True, True), ("gpt_oss", "torch", 2, True, False), ("deepseek_v3", "torch", 2, True, True)])
def test_cp_halves_equal_the_normal_prefill(four_archs, arch, backend, N, fp8, fused):
    model = _model(four_archs[arch], backend, fp8=False)
    cfg, n = model.cfg, 37  # longer than gpt-oss's window (8); not a multiple of the block size
    g = torch.Generator().manual_seed(N)
    table = torch.randperm(BLOCKS, generator=g)[: -(-n // BS)].tolist()
    x = torch.randn(n, cfg.hidden_size, generator=g)
    want = _prefill(model, x, table, _cache(cfg, torch.float32))
    attention = RingAttention.on("cpu") if fused else None
    positions, got, caches = _cp(model, x, table, N, FP8 if fp8 else torch.float32, attention)
    for pos, rank in zip(positions, got):
        for l, (ref, out) in enumerate(zip(want, rank)):
            assert (ref[2] is None) == (out[2] is None)
            for a, b in zip(ref, out):
                if a is not None:
                    torch.testing.assert_close(b, a[pos], **TOL, msg=lambda m: f"layer {l}: {m}")
    if arch == "mixtral" or arch == "qwen3_moe":
        assert got[0][0][2] is not None  # the router's logits, from the bound half
    # the owner's cache: what the normal prefill writes (with the FP8 cache: the FP8 run's), at every slot
    ref_kv = _cache(cfg, FP8 if fp8 else torch.float32)
    _prefill(_model(four_archs[arch], backend, fp8) if fp8 else model, x, table, ref_kv)
    blocks = torch.tensor(table)
    slots = blocks.repeat_interleave(BS) * BS + torch.arange(BS).repeat(len(table))
    slots = slots[:n]
    for mine, theirs in zip(caches[0].tensors(), ref_kv.tensors()):
        if fp8:  # the same e4m3 bytes
            assert torch.equal(mine.view(torch.uint8)[:, slots], theirs.view(torch.uint8)[:, slots])
        else:
            torch.testing.assert_close(mine[:, slots], theirs[:, slots], **TOL)
    for mine, theirs in zip(caches[0].scales, ref_kv.scales):
        torch.testing.assert_close(mine[:, blocks], theirs[:, blocks], rtol=1e-6, atol=0)
    for helper in caches[1:]:  # a helper rank writes nothing
        assert all((t.float() == 0).all() for t in helper.tensors())
