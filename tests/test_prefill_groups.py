"""Prefill pieces in few padded attention calls (``afdserve.backends.pytorch.prefill_groups``): the
torch attention backend (CUDA, and the CPU without the kernels) against a per-sequence float64
reference (decodes, whole prompts, chunks after a cached prefix, windows, sinks, blocks scattered
and given back); grouping keeps a long prompt from padding short ones."""

import pytest
import torch

from afdserve.backends.pytorch.attention import TorchAttention
from afdserve.backends.pytorch.norm import TorchNorm
from afdserve.backends.pytorch.prefill_groups import MAX_PADDING, SMALL_AREA, plan
from afdserve.backends.step import StepBuffers, StepLayout


def _batch(qlens, kv_lens, bs, window, g):
    """Block tables with scattered blocks; blocks wholly before every query's window are given back."""
    perm = torch.randperm(256, generator=g).tolist()
    tables = []
    for q, n in zip(qlens, kv_lens):
        t = [perm.pop() for _ in range(-(-n // bs))]
        if window:
            first = max(0, n - q - window + 1)
            t = [-1 if (j + 1) * bs <= first else b for j, b in enumerate(t)]
        tables.append(t)
    return tables, StepLayout.from_blocks(qlens, kv_lens, tables, bs)


def _reference(q, kc, vc, tables, qlens, kv_lens, bs, window, scale, sinks, nkv):
    out, start = torch.zeros(q.shape, dtype=torch.float64), 0
    for t, ql, n in zip(tables, qlens, kv_lens):
        for j in range(ql):
            pos = n - ql + j
            keys = [p for p in range(n) if p <= pos and (not window or p > pos - window)]
            slots = [t[p // bs] * bs + p % bs for p in keys]
            for h in range(q.shape[1]):
                kh = h // (q.shape[1] // nkv)
                s = (kc[slots, kh].double() @ q[start + j, h].double()) * scale
                if sinks is not None:
                    s = torch.cat([s, sinks[h].double().view(1)])
                w = torch.softmax(s, 0)[: len(slots)]
                out[start + j, h] = w @ vc[slots, kh].double()
        start += ql
    return out


@pytest.mark.parametrize("nh,nkv,hd,bs,window,sink", [(4, 2, 16, 4, 0, False), (4, 1, 8, 8, 5, True),
                                                     (2, 2, 8, 4, 0, True), (6, 3, 8, 4, 9, False)])
def test_pytorch_attention_path_matches_the_reference(nh, nkv, hd, bs, window, sink):
    g = torch.Generator().manual_seed(nh * 31 + bs + window)
    sinks = torch.randn(nh, generator=g) if sink else None
    # decodes, whole prompts of one length (one causal group), a chunk after a prefix, a long prompt
    qlens, kv_lens = [1, 9, 9, 1, 5, 40, 2, 9], [12, 9, 9, 30, 21, 40, 2, 9]
    tables, layout = _batch(qlens, kv_lens, bs, window, g)
    kc, vc = (torch.randn(256 * bs, nkv, hd, generator=g) for _ in range(2))
    q = torch.randn(sum(qlens), nh, hd, generator=g)
    attention = TorchAttention(TorchNorm())
    ctx = attention.prepare(layout, (window,), StepBuffers("cpu"))
    got = attention.attend(q, kc, vc, ctx, window, sinks, hd**-0.5)
    want = _reference(q, kc, vc, tables, qlens, kv_lens, bs, window, hd**-0.5, sinks, nkv)
    assert (got.double() - want).abs().max() < 1e-5


def test_groups_bound_the_padding_and_cover_every_new_token():
    g = torch.Generator().manual_seed(0)
    qlens, kv_lens = [400, 3, 5, 1, 4, 300], [400, 3, 9, 50, 4, 700]
    _, layout = _batch(qlens, kv_lens, 16, 0, g)
    groups = plan(layout.query_lens, layout.kv_lens, layout.block_table, 16, 0)
    assert len(groups) >= 2  # the 400-token prompt does not pad the short ones to its length
    covered = sorted(r for gr in groups for r in gr.dst.tolist())
    starts = torch.tensor([0, *qlens]).cumsum(0).tolist()
    assert covered == [r for i, n in enumerate(qlens) if n > 1 for r in range(starts[i], starts[i] + n)]
    for gr in groups:
        p, lq = gr.rows.shape
        lk = gr.slots.shape[1]
        real = sum(qlens[starts.index(int(r))] * kv_lens[starts.index(int(r))] for r in gr.rows[:, 0])
        assert p * lq * lk <= max(MAX_PADDING * real, SMALL_AREA)


def test_equal_whole_prompts_make_one_plain_causal_call():
    layout = StepLayout.from_blocks([6, 6, 6, 1], [6, 6, 6, 20], [[0, 1], [2, 3], [4, 5], [6, 7, 8, 9, 10]], 4)
    (gr,) = plan(layout.query_lens, layout.kv_lens, layout.block_table, 4, 0)
    assert gr.mask is None and tuple(gr.rows.shape) == (3, 6) and gr.dst.tolist() == list(range(18))
