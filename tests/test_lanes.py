"""Steps in flight (the attention worker's lanes): the engine's begin/finish/cancel, the scheduler's
in-flight rules, and the LM head's vocabulary shares."""

import random

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.config import EngineConfig
from afdserve.engine.builder import build_colocated
from afdserve.runtime.lm_head import LMHeadShare

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def _prompts(n, seed=5):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


def _alone(path, ps):
    with LLM(str(path), num_kv_blocks=64) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]


def _lanes_engine(path, blocks=64, **kw):
    client = build_colocated(EngineConfig(model=str(path), num_kv_blocks=blocks, **kw))
    return client, client.engine


def _queued(path, ps, **kw):
    """The outputs of running ``ps`` alone, and a lanes engine with them queued (request i: "i"),
    with an empty token list per request to collect into."""
    ref = _alone(path, ps)
    client, eng = _lanes_engine(path, **kw)
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, GREEDY)
    return client, eng, ref, {str(i): [] for i in range(len(ps))}


def _run_two_lanes(eng, order):
    """Two steps in flight at once, finished in ``order`` (a permutation of the lanes); returns the
    token outputs."""
    steps = [eng.begin(2), eng.begin(2)]
    outs = []
    for i in order:
        s = steps[i]
        if s is not None:
            outs += eng.finish(s, eng.runner.forward(s.input_ids, s.meta, s.rows))
    return outs


def test_two_steps_in_flight_take_disjoint_halves_and_match_one_at_a_time(tiny_mixtral):
    ps = _prompts(6)
    client, eng, ref, got = _queued(tiny_mixtral, ps)
    flip = 0
    while eng.has_unfinished():
        a, b = eng.begin(2), eng.begin(2)
        ids = [{s.seq_id for s in x.batch.seqs} for x in (a, b) if x is not None]
        assert len(ids) < 2 or not ids[0] & ids[1]  # no sequence in both steps
        assert eng.scheduler.in_flight == set().union(*ids)
        flip ^= 1
        for s in ([a, b] if flip else [b, a]):  # either finishes first
            if s is not None:
                for out in eng.finish(s, eng.runner.forward(s.input_ids, s.meta, s.rows)):
                    got[out.request_id] += out.new_token_ids
        assert not eng.scheduler.in_flight
    assert [got[str(i)] for i in range(len(ps))] == ref
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_a_cancelled_step_runs_again_and_changes_nothing(tiny_mixtral):
    ps = _prompts(4, seed=6)
    client, eng, ref, got = _queued(tiny_mixtral, ps)
    n = 0
    while eng.has_unfinished():
        s = eng.begin(2)
        before = [(q.num_computed, len(q.output_token_ids)) for q in s.batch.seqs]
        if n % 3 == 1:  # a lost peer: the step did not happen
            eng.runner.forward(s.input_ids, s.meta, s.rows)  # its KV writes are overwritten by the rerun
            eng.cancel(s)
            assert [(q.num_computed, len(q.output_token_ids)) for q in s.batch.seqs] == before
            assert not eng.scheduler.in_flight
        else:
            for out in eng.finish(s, eng.runner.forward(s.input_ids, s.meta, s.rows)):
                got[out.request_id] += out.new_token_ids
        n += 1
    assert [got[str(i)] for i in range(len(ps))] == ref


def test_abort_of_a_sequence_in_flight_frees_its_blocks_when_the_step_lands(tiny_mixtral):
    client, eng = _lanes_engine(tiny_mixtral)
    for i, p in enumerate(_prompts(4, seed=7)):
        eng.add_request(str(i), p, GREEDY)
    s = eng.begin(2)
    victim = s.batch.seqs[0]
    free_before = eng.blocks.num_free
    assert eng.abort(victim.request_id)
    assert eng.blocks.num_free == free_before  # the step in flight still writes its blocks
    other = eng.begin(2)  # the other lane never gets the aborted sequence or its blocks
    assert other is None or victim not in other.batch.seqs
    outs = eng.finish(s, eng.runner.forward(s.input_ids, s.meta, s.rows))
    assert victim.request_id not in {o.request_id for o in outs}
    assert victim.seq_id not in eng.blocks.tables  # freed once the step landed
    if other is not None:
        eng.finish(other, eng.runner.forward(other.input_ids, other.meta, other.rows))


def test_a_preemption_never_takes_a_sequence_in_flight(tiny_mixtral):
    """A KV cache too small for everyone: the lane that needs blocks preempts its own sequences, not
    the other lane's; outputs stay those of running alone."""
    ps = _prompts(8, seed=8)
    client, eng, ref, got = _queued(tiny_mixtral, ps, blocks=10, block_size=16, max_model_len=64)
    preempted = []
    orig = eng.scheduler._preempt

    def spy(seq, batch):
        assert seq.seq_id not in eng.scheduler.in_flight
        preempted.append(seq.request_id)
        orig(seq, batch)

    eng.scheduler._preempt = spy
    while eng.has_unfinished():
        for out in _run_two_lanes(eng, [1, 0]):
            got[out.request_id] += out.new_token_ids
    assert [got[str(i)] for i in range(len(ps))] == ref
    assert preempted, "the test should exercise preemption"


@pytest.mark.parametrize("rows,workers", [(1, [0]), (32, [0, 1]), (300, [0, 2, 5])])
def test_lm_head_shares_are_whole_blocks_that_fit_the_reply_slots(rows, workers):
    vocab, reply = 32000, 4 << 20
    lm = LMHeadShare(0.75, reply)
    shares = lm.shares(rows, vocab, workers)
    assert shares[-1][2] == vocab and all(a % 32 == 0 for _, a, _ in shares)
    assert all(b > a and (b - a) * rows * 4 <= reply for _, a, b in shares)
    assert [j for j, _, _ in shares] == workers[: len(shares)]
    assert vocab - shares[0][1] <= 0.75 * vocab + 32
    assert LMHeadShare(0.0, reply).shares(rows, vocab, workers) == []
    assert lm.shares(rows, vocab, []) == []


def test_block_table_metadata_equals_the_slot_list_metadata():
    """``AttnMetadata.from_table`` over ``BlockManager.batch_table`` (what the engine builds) describes
    the same cache positions as ``build`` over per-position slots, released blocks included; a piece
    of it (``select``) too."""
    import torch

    from afdserve.kvcache.block_manager import BlockManager
    from afdserve.model.attention import AttnMetadata

    bm = BlockManager(64, 4)
    rng = random.Random(9)
    qlens, kv_lens = [], []
    for s in range(5):
        n = rng.randrange(1, 30)
        bm.reserve(s, n)
        if s == 3:
            bm.release_before(s, n - 5)  # a sliding window gave blocks back
        kv_lens.append(n)
        qlens.append(1 if s % 2 else rng.randrange(1, n + 1))
    fast = AttnMetadata.from_table(qlens, kv_lens, bm.batch_table(list(range(5))), 4)
    slow = AttnMetadata.build(qlens, [bm.slots(s, n) for s, n in enumerate(kv_lens)])
    assert torch.equal(fast.positions, slow.positions) and torch.equal(fast.slot_mapping, slow.slot_mapping)
    assert all(torch.equal(a, b) for a, b in zip(fast.kv_slots, slow.kv_slots))
    assert torch.equal(fast.decode_rows, slow.decode_rows) and torch.equal(fast.decode_seqs, slow.decode_seqs)
    part = fast.select([1, 4], [1, 1], [kv_lens[1], kv_lens[4] - qlens[4] + 1])
    assert part.kv_lens == [kv_lens[1], kv_lens[4] - qlens[4] + 1]
    assert torch.equal(part.kv_slots[1], slow.kv_slots[4][: part.kv_lens[1]])


def test_lm_head_shares_skip_expert_workers_busy_with_another_lane():
    lm = LMHeadShare(0.75, 4 << 20)
    assert [j for j, _, _ in lm.shares(32, 32000, [0, 1, 2], busy={1})] == [0, 2]
    assert lm.shares(32, 32000, [0, 1], busy={0, 1}) == []  # every one busy: all of it computed here
    assert lm.shares(32, 32000, [0], busy=set()) == lm.shares(32, 32000, [0])


def test_busy_expert_workers_get_lm_head_shares_only_behind_short_layers():
    """A share waits behind the busy worker's layer: worth it where a layer's round trip is short
    against the LM head (a big vocabulary, the demo model), not where it is long (the ping-pong
    model's small vocabulary behind 4 ms layers), nor before anything was measured."""
    from afdserve.runtime.lm_head import BUSY_SHARE_MAX_WAIT, unshared_busy

    work, rate = 32 * 32000, 32 * 32000 / 2e-3  # a 2 ms LM head
    assert unshared_busy({0, 1}, work, rate, layer_rtt=0.6e-3) == set()
    assert unshared_busy({0, 1}, work, rate, layer_rtt=BUSY_SHARE_MAX_WAIT * 2e-3) == set()
    assert unshared_busy({0, 1}, work, rate, layer_rtt=4e-3) == {0, 1}
    assert unshared_busy({1}, work, 0.0, layer_rtt=0.6e-3) == {1}  # no rate measured yet
    assert unshared_busy({1}, work, rate, layer_rtt=0.0) == {1}  # no layer measured yet
    assert unshared_busy(set(), work, rate, layer_rtt=4e-3) == set()



def test_a_plain_greedy_step_asks_the_runner_for_token_ids(tiny_mixtral):
    """A step whose rows all sample plainly greedily gets token ids from the runner (the argmax taken
    in the LM head), the argmax of the logits it would get otherwise; finish takes either. A request
    asking for logprobs (or any other use of the logits) makes its steps use the logits."""
    client, eng = _lanes_engine(tiny_mixtral)
    for i, p in enumerate(_prompts(5, seed=9)):
        eng.add_request(str(i), p, GREEDY)
    eng.add_request("lp", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2))
    seen = {True: 0, False: 0}
    while eng.has_unfinished():
        s = eng.begin()
        logits = eng.runner.forward(s.input_ids, s.meta, s.rows)
        ids = eng.runner.forward(s.input_ids, s.meta, s.rows, greedy=True)
        assert ids.dtype == torch.int64 and torch.equal(ids, torch.argmax(logits, dim=-1))
        assert s.greedy == all(seq.request_id != "lp" for seq, _ in s.sampled)
        seen[s.greedy] += 1
        outs = eng.finish(s, ids if s.greedy else logits)
        assert all((o.logprobs is not None) == (o.request_id == "lp") for o in outs if o.new_token_ids)
    assert seen[True] and seen[False]
