"""Expert placement changes while serving: nothing fails, outputs stay identical."""

import random

import pytest

from afdserve import LLM, SamplingParams
from afdserve.balance.attention import AttentionBalancer
from afdserve.balance.placement import LayerPlacement, Placement

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def _prompts(n=6, seed=4):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def _run(llm, ps, replan=None):
    eng = llm.engine
    for i, p in enumerate(ps):
        eng.add_request({"prompt_token_ids": p}, GREEDY, request_id=str(i))
    done, steps = {}, 0
    while len(done) < len(ps):
        for out in eng.get_outputs(timeout=1.0):
            assert out.error is None, out.error
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
        steps += 1
        if replan is not None and steps == 4:
            replan(eng)
    return [done[i] for i in range(len(ps))]


@pytest.mark.parametrize("gate", ["attention", "expert"])
def test_replan_mid_run_keeps_outputs(tiny_mixtral, gate):
    ps = _prompts()
    kw = dict(num_kv_blocks=64, attention_workers=2, expert_workers=2, micro_batches=2, gate=gate)
    with LLM(str(tiny_mixtral), **kw) as llm:
        ref = _run(llm, ps)
    # 6 experts on 2 workers x 4 slots: experts 0 and 1 get a replica on each worker
    layer = LayerPlacement(6, ((0, 1, 2, 3), (0, 1, 4, 5)))
    new = Placement(tuple(layer for _ in range(2)))
    with LLM(str(tiny_mixtral), **kw) as llm:
        got = _run(llm, ps, replan=lambda eng: eng.rebalance(placement=new))
        assert llm.engine.expert_map.placement == new
        held = llm.engine.worker_stats()
        assert held["expert0"].experts[0] == [0, 1, 2, 3] and held["expert1"].experts[0] == [0, 1, 4, 5]
        load = llm.engine.expert_load()
        assert load is not None and int(load.tokens.sum()) > 0
        # planned from the recorded load, then served again
        llm.engine.rebalance(slots_per_worker=4)
        again = _run(llm, ps)
    assert got == ref
    assert again == ref


def test_attention_balance_counts_context_not_requests():
    b = AttentionBalancer(["a0", "a1"])
    b.add("a0", "long", 2000)  # one long request
    for i in range(4):
        b.add("a1", f"s{i}", 20)  # four short ones
    # by request count a0 would get the next request; by predicted time a1 does
    assert b.pick(prompt_len=20, max_tokens=16) == "a1"
