"""Prefill/decode disaggregation (``--prefill-workers``/``--decode-workers``): the KV moves layer by
layer from the prefill worker into the decode worker's reserved blocks; outputs equal the single
pool's; lost workers and aborts lose no request and leak no block."""

import os
import random
import signal
import time

import pytest

from afdserve import LLM, SamplingParams
from afdserve.config import EngineConfig
from afdserve.errors import ConfigError
from polling import wait_until

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
# chunks of 24 tokens over blocks of 16: a layer's transfer ends inside a block the next chunk fills
COMMON = dict(dtype="float32", block_size=16, num_kv_blocks=96, max_num_batched_tokens=24, max_model_len=512)
PD = dict(expert_workers=1, prefill_workers=1, decode_workers=1)


def _prompts():
    rng = random.Random(3)
    first = [[rng.randrange(3, 256) for _ in range(n)] for n in (56, 9, 70)]
    # sharing 48 tokens (3 blocks) with the first: the decode worker's prefix cache skips those blocks
    return first, [first[0][:48] + [rng.randrange(3, 256) for _ in range(n)] for n in (5, 30)]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _idle(llm) -> bool:
    """Every attention worker's cache is back to no block held (cached blocks count as free) and
    no decode worker holds a reservation."""
    st = llm.engine.worker_stats()
    return all(s.kv_usage == 0 and s.kv_reserved == 0 and s.running == 0 for n, s in st.items()
               if n.startswith("attention"))


@pytest.mark.parametrize("arch,kv", [("mixtral", "auto"), ("qwen3_moe", "auto"), ("deepseek_v3", "auto"),
                                     ("gpt_oss", "auto"), ("mixtral", "fp8_e4m3"), ("deepseek_v3", "fp8_e4m3")])
def test_pd_matches_the_single_pool(four_archs, arch, kv):
    """1 prefill + 1 decode attention worker give the colocated engine's greedy tokens (float32; with
    the fp8 cache its blocks and scales move as stored), also when the decode worker's prefix cache
    holds part of a prompt; every prompt's KV lands on the decode worker, and no block stays held."""
    first, second = _prompts()
    # fp8 blocks are re-scaled where a chunk ends inside them, so they depend on the chunks: a budget
    # that prefills each batch in one step, as the single pool does (its decodes change its chunks)
    cfg = COMMON | dict(kv_cache_dtype=kv) | (dict(max_num_batched_tokens=256) if kv != "auto" else {})
    with LLM(str(four_archs[arch]), **cfg) as llm:
        want = [_ids(llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)) for ps in (first, second)]
    with LLM(str(four_archs[arch]), **cfg, **PD) as llm:
        got = [_ids(llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)) for ps in (first, second)]
        assert got == want
        st = llm.engine.worker_stats()
        landed = st["attention1"].kv_landed
        assert sorted(r.tokens for r in landed) == sorted(len(p) for p in first + second)
        assert all(r.prefill_start_ns <= r.last_layer_ns <= r.landed_ns for r in landed)
        assert st["attention1"].prefix.hit_tokens >= 2 * 48  # the second batch's shared blocks were not sent
        assert wait_until(lambda: _idle(llm), 10), llm.engine.worker_stats()


def test_roles_are_checked():
    with pytest.raises(ConfigError, match="both pools"):
        EngineConfig(model="x", dtype="float32", expert_workers=1, prefill_workers=1)
    with pytest.raises(ConfigError, match="their sum"):
        EngineConfig(model="x", dtype="float32", expert_workers=1, prefill_workers=1, decode_workers=1,
                     attention_workers=3)
    with pytest.raises(ConfigError, match="expert_workers >= 1"):
        EngineConfig(model="x", dtype="float32", prefill_workers=1, decode_workers=1)
    assert EngineConfig(model="x", dtype="float32", expert_workers=1, prefill_workers=2,
                        decode_workers=1).attention_workers == 3


def _run_and(llm, prompts, params, when, act):
    """Generates ``prompts``; ``act()`` once, as soon as ``when(output)`` holds for an output."""
    ids = [llm.engine.add_request(p, params) for p in prompts]
    done, acted = {}, False
    deadline = time.monotonic() + 180
    while len(done) < len(ids):
        assert time.monotonic() < deadline, "generation hung"
        for o in llm.engine.get_outputs(timeout=0.5):
            assert o.error is None, o.error
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
            if not acted and when(o):
                act(o)
                acted = True
    assert acted
    return [done.get(r) for r in ids]


def _mid_prefill(o) -> bool:
    """The long prompt is part-way through its prefill: some layers' KV of it has gone over."""
    return o.prefill is not None and 48 <= o.prefill.done < o.prefill.total - 48


@pytest.mark.parametrize("victim", ["attention0", "attention1"])
def test_a_worker_lost_mid_transfer_loses_no_request(four_archs, victim):
    """kill -9 the prefill worker, or the decode worker, while a long prompt's KV is moving (and
    shorter requests decode): it is replaced, the requests start over or are recomputed, greedy
    outputs equal the fault-free run's, and no block stays held on either side."""
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 256) for _ in range(n)]} for n in (12, 20, 300)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(str(four_archs["mixtral"]), **COMMON) as llm:
        want = _ids(llm.generate(prompts, params))
    with LLM(str(four_archs["mixtral"]), **COMMON, **PD) as llm:
        pid = llm.engine.workers[victim].pid

        def kill(o):
            assert any(mv.handle is not None for mv in llm.engine.pd.moving.values())  # a transfer under way
            os.kill(pid, signal.SIGKILL)

        got = _run_and(llm, prompts, params, _mid_prefill, kill)
        assert got == want
        assert llm.engine.membership.restarts == {victim: 1} and llm.engine.failed is None
        assert wait_until(lambda: _idle(llm), 10), llm.engine.worker_stats()
        assert _ids(llm.generate(prompts, params)) == want  # and serving goes on


def test_an_abort_mid_transfer_frees_both_sides(four_archs):
    rng = random.Random(6)
    long = {"prompt_token_ids": [rng.randrange(3, 256) for _ in range(300)]}
    with LLM(str(four_archs["mixtral"]), **COMMON, **PD) as llm:
        rid = llm.engine.add_request(long, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline
            outs = llm.engine.get_outputs(timeout=0.5)
            if any(_mid_prefill(o) for o in outs):
                break
        llm.engine.abort(rid)
        assert wait_until(lambda: _idle(llm), 20), llm.engine.worker_stats()
        short = {"prompt_token_ids": long["prompt_token_ids"][:40]}
        assert len(_ids(llm.generate([short], GREEDY))[0]) == GREEDY.max_tokens


def test_bench_pd_measures_the_transfer(four_archs):
    """``afdserve bench pd``'s transfer measurement: the decode worker's record of one prompt."""
    from afdserve.bench.pd import report, transfer_tail

    (t,) = transfer_tail(str(four_archs["mixtral"]), [200], budget=64)
    assert t.tokens == 200 and t.prefill_s > 0 and t.tail_s > 0 and t.share < 1
    assert "| 200 |" in report([t], [])
