"""Context-parallel prefill (``--context-parallel-size``): a long prompt split over two attention
workers (zigzag), its attention passed around the ring, its KV gathered at the owner, gives the
same greedy continuation and prompt logprobs as the prompt prefilled on one worker."""

import os
import random
import signal
import time

import pytest

from afdserve import LLM, SamplingParams
from polling import wait_until
from conftest import LONG_POSITIONS

LONG = 16384  # the prompt length
POSITIONS = LONG_POSITIONS


def _deployment(path, cp: int, **over):
    # a CP shard runs in one step: the budget holds half the long prompt; the cache holds it whole
    cfg = dict(dtype="float32", attention_workers=2, expert_workers=1, block_size=16, num_kv_blocks=LONG // 16 + 64,
               max_num_batched_tokens=LONG // 2, max_model_len=POSITIONS, context_parallel_size=cp,
               cp_min_tokens=1024)
    return LLM(str(path), **(cfg | over))


def _cp_steps(llm) -> int:
    return sum(s.cp_steps for n, s in llm.engine.worker_stats().items() if n.startswith("attention"))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_cp2_matches_cp1(long_archs, arch):
    """A 16k-token prompt (with prompt logprobs) and a short one beside it: CP = 2 gives CP = 1's
    greedy tokens and prompt logprobs (within 1e-4 of their size); both ranks ran the long prompt's
    step, and no block stays held."""
    rng = random.Random(7)
    long = [rng.randrange(3, 250) for _ in range(LONG)]
    short = [rng.randrange(3, 250) for _ in range(40)]
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0),
              SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)]
    prompts = [{"prompt_token_ids": long}, {"prompt_token_ids": short}]
    with _deployment(long_archs[arch], 1) as llm:
        want = llm.generate(prompts, params)
    with _deployment(long_archs[arch], 2) as llm:
        got = llm.generate(prompts, params)
        # the long prompt's step on each rank (a helper may end its step after the owner's outputs); the
        # short one was not split
        assert wait_until(lambda: _cp_steps(llm) == 2, 10), _cp_steps(llm)
        assert wait_until(lambda: all(s.kv_usage == 0 for n, s in llm.engine.worker_stats().items()
                                      if n.startswith("attention")), 10)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    lp_want, lp_got = want[0].prompt_logprobs, got[0].prompt_logprobs
    assert len(lp_got) == len(lp_want) == LONG
    # float32 over 16k keys in another order: 1e-4 of the logprob's size (gpt-oss's reach ~20 nats)
    worst = max(abs(lp_got[j][long[j]].logprob - lp_want[j][long[j]].logprob)
                / max(1.0, abs(lp_want[j][long[j]].logprob)) for j in range(1, LONG))
    print(f"{arch}: prompt logprobs CP=2 vs CP=1, largest difference {worst:.2e} of the logprob's size")
    assert worst < 1e-4, worst


def _idle(llm) -> bool:
    return all(s.kv_usage == 0 and s.running == 0 for n, s in llm.engine.worker_stats().items()
               if n.startswith("attention"))


def _collect(llm, ids, act) -> dict:
    """Outputs of the requests ``ids`` until each finished (``act()`` once, right away)."""
    act()
    done, deadline = {}, time.monotonic() + 240
    while len(done) < len(ids):
        assert time.monotonic() < deadline, "generation hung"
        for o in llm.engine.get_outputs(timeout=0.5):
            if o.finished:
                done[o.request_id] = o
    return done


_LOST_RNG = random.Random(11)
LOST_PROMPTS = [{"prompt_token_ids": [_LOST_RNG.randrange(3, 250) for _ in range(n)]} for n in (LONG // 2, 30)]
LOST_PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def fault_free(long_archs) -> list[list[int]]:
    """CP = 1's greedy outputs of ``LOST_PROMPTS``: the fault-free run every victim's run must equal."""
    with _deployment(long_archs["mixtral"], 1) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(LOST_PROMPTS, LOST_PARAMS)]


@pytest.mark.parametrize("victim", ["attention0", "attention1", "expert0"])
def test_a_rank_lost_during_the_prefill_loses_no_request(long_archs, fault_free, victim):
    """kill -9 either attention worker (a rank) or the expert worker as a long prompt's CP prefill
    starts (a short request beside it): the worker is replaced, the prefill starts over (on new ranks,
    or on the same ones after the new links), greedy outputs equal the fault-free run's, and no block
    stays held."""
    prompts, params, want = LOST_PROMPTS, LOST_PARAMS, fault_free
    with _deployment(long_archs["mixtral"], 2) as llm:
        pid = llm.engine.workers[victim].pid
        ids = [llm.engine.add_request(p, params) for p in prompts]
        done = _collect(llm, ids, lambda: os.kill(pid, signal.SIGKILL))
        assert [done[r].error for r in ids] == [None, None]
        assert [done[r].outputs[0].token_ids for r in ids] == want
        assert llm.engine.membership.restarts == {victim: 1} and llm.engine.failed is None
        assert wait_until(lambda: _idle(llm), 10), llm.engine.worker_stats()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want  # serving goes on


def test_an_abort_during_the_prefill_frees_every_rank(long_archs):
    """A long prompt aborted as its CP prefill starts: nothing hangs, no block stays held on either
    rank, and the next CP prefill runs (its handle after the aborted one's)."""
    rng = random.Random(12)
    long = {"prompt_token_ids": [rng.randrange(3, 250) for _ in range(LONG // 2)]}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with _deployment(long_archs["mixtral"], 2) as llm:
        rid = llm.engine.add_request(long, params)
        llm.engine.abort(rid)
        assert wait_until(lambda: _idle(llm) and not llm.engine.get_outputs(), 20), llm.engine.worker_stats()
        (out,) = llm.generate([long], params)
        assert len(out.outputs[0].token_ids) == 6
        assert wait_until(lambda: _cp_steps(llm) >= 2, 10), _cp_steps(llm)  # (a helper may end after the owner)


def test_bench_cp_measures_both_deployments(long_archs):
    """``afdserve bench cp``: paired rounds of CP = 1 and CP = 2 on one prompt length, and the ideal
    ratio from CP = 1's traced split of attention and expert time; with ``decode``, the time per
    output token after it of CP = 1, CP = 2 gathered and CP = 2 sharded."""
    from afdserve.bench.cp import measure, report

    res = measure(str(long_archs["mixtral"]), 2048, rounds=1, decode=4)
    (r,) = res.rounds
    assert r.cp1_s > 0 and r.cp2_s > 0 and r.shard_s > 0 and res.attention_s > 0 and res.expert_s > 0
    assert r.tpot1_s > 0 and r.tpot2_s > 0 and r.tpot_shard_s > 0
    assert 0.5 <= res.ideal < 1
    text = report(res)
    assert "median ratio CP=2/CP=1" in text and "median sharded/gathered time per output token" in text
