"""Steps in flight (the attention worker's lanes): the engine's begin/finish/cancel and the
scheduler's in-flight rules."""

import random
from dataclasses import replace

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.config import EngineConfig
from afdserve.engine.builder import build_colocated

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
            outs += eng.finish(s, eng.runner.forward(s.model_input))
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
                for out in eng.finish(s, eng.runner.forward(s.model_input)):
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
            eng.runner.forward(s.model_input)  # its KV writes are overwritten by the rerun
            eng.cancel(s)
            assert [(q.num_computed, len(q.output_token_ids)) for q in s.batch.seqs] == before
            assert not eng.scheduler.in_flight
        else:
            for out in eng.finish(s, eng.runner.forward(s.model_input)):
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
    outs = eng.finish(s, eng.runner.forward(s.model_input))
    assert victim.request_id not in {o.request_id for o in outs}
    assert victim.seq_id not in eng.blocks.tables  # freed once the step landed
    if other is not None:
        eng.finish(other, eng.runner.forward(other.model_input))


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


def test_a_steps_layout_over_block_tables_addresses_each_sequences_own_slots():
    """``StepLayout.of`` over ``BlockManager.batch_table`` (what the engine builds) gives every new
    token its position and the cache slot its sequence holds there, released blocks included."""
    from afdserve.backends.step import StepLayout
    from afdserve.kvcache.block_manager import BlockManager

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
    layout = StepLayout.of(qlens, kv_lens, bm.batch_table(list(range(5))), 4)
    positions = [p for q, n in zip(qlens, kv_lens) for p in range(n - q, n)]
    slots = [int(bm.slots(s, n)[p]) for s, (q, n) in enumerate(zip(qlens, kv_lens)) for p in range(n - q, n)]
    assert layout.positions.tolist() == positions and layout.slot_mapping.tolist() == slots
    assert layout.decode_seqs.tolist() == [i for i, q in enumerate(qlens) if q == 1]
    assert layout.first_rows.tolist() == [sum(qlens[:i]) for i in range(5)]


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
        logits = eng.runner.forward(replace(s.model_input, greedy=False))
        ids = eng.runner.forward(replace(s.model_input, greedy=True))
        assert logits.token_ids is None and ids.logits is None
        assert ids.token_ids.dtype == torch.int64 and torch.equal(ids.token_ids, torch.argmax(logits.logits, dim=-1))
        greedy = s.model_input.greedy
        assert greedy == all(seq.request_id != "lp" for seq, _ in s.sampled)
        seen[greedy] += 1
        outs = eng.finish(s, ids if greedy else logits)
        assert all((o.logprobs is not None) == (o.request_id == "lp") for o in outs if o.new_token_ids)
    assert seen[True] and seen[False]
