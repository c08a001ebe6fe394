"""Continuous batching and KV-cache pressure keep outputs identical to running alone."""

import random

from afdserve import LLM, SamplingParams
from afdserve.config import EngineConfig
from afdserve.engine.builder import build_colocated

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _prompts(n, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(2, 40))] for _ in range(n)]


def _alone(path, ps, params=GREEDY):
    """Each prompt run by itself (``params``: one for all, or one per prompt)."""
    each = params if isinstance(params, list) else [params] * len(ps)
    with LLM(str(path), num_kv_blocks=64) as llm:
        return [llm.generate([{"prompt_token_ids": p}], q)[0].outputs[0].token_ids for p, q in zip(ps, each)]


def _preemptions(llm) -> list[str]:
    """The request ids ``llm``'s scheduler preempts from now on, in order."""
    preempted: list[str] = []
    sched = llm.engine.engine.scheduler
    orig = sched._preempt

    def spy(seq, batch):
        preempted.append(seq.request_id)
        orig(seq, batch)

    sched._preempt = spy
    return preempted


def test_requests_joining_at_different_steps(tiny_mixtral):
    ps = _prompts(6)
    ref = _alone(tiny_mixtral, ps)
    eng = build_colocated(EngineConfig(model=str(tiny_mixtral), num_kv_blocks=64, max_num_batched_tokens=32))
    got, pending, step = {}, list(enumerate(ps)), 0
    while pending or eng.has_unfinished():
        if pending and step % 3 == 0:  # a new request every third step, while others decode
            i, p = pending.pop(0)
            eng.add_request({"prompt_token_ids": p}, GREEDY, request_id=str(i))
        for out in eng.get_outputs():
            if out.finished:
                got[int(out.request_id)] = out.outputs[0].token_ids
        step += 1
    assert [got[i] for i in range(len(ps))] == ref


def test_more_requests_than_the_kv_cache_holds(tiny_mixtral):
    ps = _prompts(12, seed=2)
    ref = _alone(tiny_mixtral, ps)
    # 12 blocks of 16 tokens: a few sequences at a time; the rest wait or get preempted
    llm = LLM(str(tiny_mixtral), num_kv_blocks=12, block_size=16, max_model_len=128)
    preempted = _preemptions(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert preempted, "the test should exercise preemption"
    assert llm.engine.engine.blocks.num_free == 12
    llm.shutdown()


def test_preempted_sequences_with_penalties_rejoin_with_their_counts(tiny_mixtral):
    """Under KV pressure sequences are preempted and recomputed; with penalties (counted from the
    output, in the sampling state's rows: ``afdserve.engine.sampling_state``) their tokens are those
    of each request alone, and every row is freed at the end."""
    ps = _prompts(10, seed=5)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, frequency_penalty=1.5,
                             repetition_penalty=1.3),
              SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True, presence_penalty=1.0)]
    each = [params[i % 2] for i in range(len(ps))]
    alone = _alone(tiny_mixtral, ps, each)
    llm = LLM(str(tiny_mixtral), num_kv_blocks=12, block_size=16, max_model_len=128)
    preempted = _preemptions(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], each)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert preempted, "the test should exercise preemption"
    assert len(llm.engine.engine.sampling) == 0  # every row freed
    llm.shutdown()

def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_mixtral):
    ps = _prompts(3, seed=3)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    with LLM(str(tiny_mixtral), num_kv_blocks=64) as llm:
        batched = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]
        alone = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in ps]
        greedy_k1 = llm.generate([{"prompt_token_ids": ps[0]}], SamplingParams(max_tokens=16, top_k=1, ignore_eos=True))
        greedy_t0 = llm.generate([{"prompt_token_ids": ps[0]}], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert batched == alone
    assert greedy_k1[0].outputs[0].token_ids == greedy_t0[0].outputs[0].token_ids
