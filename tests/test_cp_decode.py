"""Decode over sharded KV (``afdserve.backends.pytorch.cp_decode``, ``afdserve.engine.cp``): after a
context-parallel prefill whose ranks keep their own pieces' KV (compact), a decode step of the owner
-- its own keys plus every helper's partial over its shard, merged -- equals the normal decode step
over the whole prompt's KV, for GQA, q/k norms, windows with sinks and MLA, with plain and FP8
caches, over several decode steps."""

import dataclasses
import queue
import threading

import numpy as np
import pytest
import torch

from afdserve.backends.pytorch.cp_decode import sharded_attention, sharded_latent
from afdserve.backends.pytorch.cp_half import cp_attention, cp_latent
from afdserve.backends.pytorch.ring import RingAttention
from afdserve.backends.step import AttnContext, CPContext, StepBuffers, StepLayout
from afdserve.engine.cp import CPShard, compact_slots, cp_layout, sharded_layout
from afdserve.kvcache.cp_split import zigzag
from afdserve.kvcache.fp8 import FP8
from afdserve.model.mla import MLAPart
from test_cp_attention import BS, BLOCKS, TOL, _cache, _layer, _model, _Ring  # the CP halves' test's pieces



class _Peers:
    """The helpers of a sharded decode step, in process: each answers with ``shard_partial`` over its cache."""

    def __init__(self, model, helpers):
        self.model, self.helpers, self.asked = model, helpers, {}

    def ask(self, layer, q, positions):
        self.asked[layer] = (q.clone(), positions.clone())

    def answers(self, layer):
        q, pos = self.asked.pop(layer)
        return [self.model.shard_partial(layer, kv, q, pos, torch.from_numpy(slots), torch.from_numpy(kpos))
                for kv, slots, kpos in self.helpers]


def _sharded_prefill(model, x, shards, tables, kv_dtype):
    """Every rank's CP halves (keep: its own KV only, compact in its blocks) in threads; their caches."""
    inboxes = [queue.Queue() for _ in shards]
    caches, errors = [_cache(model.cfg, kv_dtype) for _ in shards], []

    def run(r):
        try:
            shard = shards[r]
            layout, slots = cp_layout(shard, tables[r], BS)
            assert slots == {}
            base = model.context(layout, StepBuffers("cpu"))
            fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(AttnContext)}
            ctx = CPContext(**fields, ring=_Ring(inboxes, r), owner=r == 0, attention=RingAttention.on("cpu"),
                            pieces=shard.pieces, rank=r, keep=True)
            mine = x[torch.from_numpy(shard.positions())]
            for l, part in enumerate(model.attn):
                kv = caches[r]
                if isinstance(part, MLAPart):
                    cp_latent(part, l, mine, ctx, kv.latent(l))
                else:
                    cp_attention(part, l, mine, ctx, kv.keys(l), kv.values(l))
        except BaseException as e:  # noqa: BLE001 -- re-raised by the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return caches


@pytest.mark.parametrize("arch,N,fp8", [("mixtral", 2, False), ("qwen3_moe", 3, False), ("gpt_oss", 2, False),
                                        ("gpt_oss", 3, False), ("deepseek_v3", 2, False), ("deepseek_v3", 3, False),
                                        ("mixtral", 2, True), ("gpt_oss", 3, True), ("deepseek_v3", 2, True)])
def test_sharded_decode_equals_the_normal_decode(four_archs, arch, N, fp8):
    model = _model(four_archs[arch], "torch", fp8)
    cfg, n, steps = model.cfg, 37, 3  # longer than gpt-oss's window (8): some shards fall out of it
    kv_dtype = FP8 if fp8 else torch.float32
    g = torch.Generator().manual_seed(N + 10 * fp8)
    x = torch.randn(n + steps, cfg.hidden_size, generator=g)  # the prompt, then each decode step's input
    # the reference: the whole prompt prefilled on one cache, then decoded there
    table = torch.randperm(BLOCKS, generator=g)[: -(-(n + steps) // BS)].tolist()
    ref_kv = _cache(cfg, kv_dtype)
    ctx = model.context(StepLayout.from_blocks([n], [n], [table], BS), StepBuffers("cpu"))
    for l in range(cfg.num_layers):
        _layer(model, l, x[:n], ctx, ref_kv)
    # sharded: every rank keeps its pieces in blocks of its own
    pieces = zigzag(n, N, BS)
    shards = [CPShard(1, r, tuple(range(N)), pieces, keep=True) for r in range(N)]
    tables = []
    for s in shards:
        need = -(-(s.held + (steps if s.owner else 0)) // BS)
        tables.append(torch.randperm(BLOCKS, generator=g)[:need].tolist())
    caches = _sharded_prefill(model, x[:n], shards, tables, kv_dtype)
    helpers = [(caches[r], compact_slots(tables[r], shards[r].held, BS), shards[r].positions()) for r in range(1, N)]
    for step in range(steps):
        pos = n + step
        want_ctx = model.context(StepLayout.from_blocks([1], [pos + 1], [table], BS), StepBuffers("cpu"))
        layout, sd = sharded_layout(shards[0], tables[0], pos, BS)
        assert sd.positions[-1] == pos and sd.slots.shape == sd.positions.shape
        assert sd.positions.shape[0] == shards[0].held + step + 1
        ctx = model.sharded_context(layout, StepBuffers("cpu"), _Peers(model, helpers), sd.slots, sd.positions)
        torch.testing.assert_close(ctx.cos, want_ctx.cos)  # rotated at the token's true position
        xi = x[pos : pos + 1]
        for l, part in enumerate(model.attn):
            want = _layer(model, l, xi, want_ctx, ref_kv)
            if isinstance(part, MLAPart):
                got = (*sharded_latent(part, l, xi, ctx, caches[0].latent(l)), None)
            else:
                got = sharded_attention(part, l, xi, ctx, caches[0].keys(l), caches[0].values(l))
            assert (want[2] is None) == (got[2] is None)
            for a, b in zip(want, got):
                if a is not None:
                    torch.testing.assert_close(b, a, **TOL, msg=lambda m: f"step {step} layer {l}: {m}")


def test_sharded_layout_writes_after_the_owners_pieces():
    """The owner's compact slots: its pieces in its blocks in order, then each decoded token."""
    pieces = zigzag(40, 2, 4)  # c = 12: chunks [0,12) [12,24) [24,36) [36,40); the owner: [0,12) and [36,40)
    shard = CPShard(3, 0, (0, 1), pieces, keep=True)
    assert (shard.total, shard.held) == (40, 16)
    layout, sd = sharded_layout(shard, [5, 2, 9, 7, 1], 41, 4)
    assert sd.positions.tolist() == list(range(12)) + list(range(36, 42))
    assert sd.slots.tolist() == compact_slots([5, 2, 9, 7, 1], 18, 4).tolist()
    assert layout.positions.tolist() == [41] and layout.slot_mapping.tolist() == [sd.slots[-1]] == [1 * 4 + 1]
    helper = CPShard(3, 1, (0, 1), pieces, keep=True)
    step, slots = cp_layout(helper, [4, 6, 0, 3, 8, 11], 4)
    assert slots == {} and step.positions.tolist() == list(range(12, 36))
    assert np.array_equal(step.slot_mapping, compact_slots([4, 6, 0, 3, 8, 11], 24, 4))
