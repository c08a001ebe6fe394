"""Prefill pieces in few padded attention calls (``afdserve.model.prefill_groups``): the PyTorch
attention path (CUDA, and the CPU without the kernels) against a per-sequence float64 reference
(decodes, whole prompts, chunks after a cached prefix, windows, sinks, blocks scattered and given
back); grouping keeps a long prompt from padding short ones; the MLA prefill path takes them too."""

import pytest
import torch

from afdserve.model.attention import AttentionPart, AttnMetadata
from afdserve.model.config import ModelConfig
from afdserve.model.prefill_groups import MAX_PADDING, SMALL_AREA


def _cfg(nh, nkv, hd, sinks=False):
    return ModelConfig.from_dict(dict(model_type="mixtral", vocab_size=64, hidden_size=nh * hd, intermediate_size=16,
                                      num_hidden_layers=1, num_attention_heads=nh, num_key_value_heads=nkv,
                                      head_dim=hd, num_local_experts=2, num_experts_per_tok=1))


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
    return tables, AttnMetadata.from_blocks(qlens, kv_lens, tables, bs)


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
    part = AttentionPart(_cfg(nh, nkv, hd, sink), torch.float32, window=window)
    if sink:
        part.sinks = torch.nn.Parameter(torch.randn(nh, generator=g), requires_grad=False)
    # decodes, whole prompts of one length (one causal group), a chunk after a prefix, a long prompt
    qlens, kv_lens = [1, 9, 9, 1, 5, 40, 2, 9], [12, 9, 9, 30, 21, 40, 2, 9]
    tables, meta = _batch(qlens, kv_lens, bs, window, g)
    kc, vc = (torch.randn(256 * bs, nkv, hd, generator=g) for _ in range(2))
    q = torch.randn(sum(qlens), nh, hd, generator=g)
    got = part._attend(q, kc, vc, meta)
    want = _reference(q, kc, vc, tables, qlens, kv_lens, bs, window, part.scale, part.sinks, nkv)
    assert (got.double() - want).abs().max() < 1e-5


def test_groups_bound_the_padding_and_cover_every_new_token():
    g = torch.Generator().manual_seed(0)
    qlens, kv_lens = [400, 3, 5, 1, 4, 300], [400, 3, 9, 50, 4, 700]
    _, meta = _batch(qlens, kv_lens, 16, 0, g)
    groups = meta.prefill_groups()
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
    meta = AttnMetadata.from_blocks([6, 6, 6, 1], [6, 6, 6, 20], [[0, 1], [2, 3], [4, 5], [6, 7, 8, 9, 10]], 4)
    (gr,) = meta.prefill_groups()
    assert gr.mask is None and tuple(gr.rows.shape) == (3, 6) and gr.dst.tolist() == list(range(18))
