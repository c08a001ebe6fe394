"""A prompt whose KV does not fit one attention worker's cache, served with context parallelism 2:
its KV stays sharded over both workers after the CP prefill and every decode step merges the
helper's partial attention (``--cp-kv``, ``afdserve.backends.pytorch.cp_decode``). Outputs equal a
worker whose cache holds it whole; a lost owner or helper mid-decode, or an abort, loses nothing and
leaves no block or shard held."""

import os
import random
import signal
import time

import pytest

from afdserve import LLM, SamplingParams
from polling import wait_until

PROMPT = 2048
BLOCKS = 100  # 1600 tokens a worker: the prompt's 2048 do not fit one, its halves do


def _deployment(path, cp: int, blocks: int, **over):
    cfg = dict(dtype="float32", attention_workers=2, expert_workers=1, block_size=16, num_kv_blocks=blocks,
               max_num_batched_tokens=1024, max_model_len=3000, context_parallel_size=cp, cp_min_tokens=1024)
    return LLM(str(path), **(cfg | over))


def _attention(llm) -> dict:
    return {n: s for n, s in llm.engine.worker_stats().items() if n.startswith("attention")}


def _idle(llm) -> bool:
    return all(s.kv_usage == 0 and s.running == 0 and s.shards == 0 for s in _attention(llm).values())


def _prompts(seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(n)]} for n in (PROMPT, 40)]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_a_prompt_that_does_not_fit_one_worker_is_served_sharded(long_archs, arch):
    """CP = 2 with caches of 1600 tokens each serves a 2048-token prompt (a short one beside it): the
    greedy tokens of a worker holding it whole, their logprobs within 1e-4 of their size; every
    decode step but the first ran over the shards, and nothing stays held."""
    prompts, n = _prompts(7), 8
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0)
    with _deployment(long_archs[arch], 1, 300) as llm:
        want = llm.generate(prompts, params)
    with _deployment(long_archs[arch], 2, BLOCKS) as llm:
        got = llm.generate(prompts, params)
        stats = _attention(llm)
        assert sorted(s.sharded_steps for s in stats.values()) == [0, n - 1]  # the owner's
        assert sorted(s.cp_steps for s in stats.values()) == [1, 1]
        assert wait_until(lambda: _idle(llm), 10), _attention(llm)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    worst = max(abs(pg[tok].logprob - pw[tok].logprob) / max(1.0, abs(pw[tok].logprob))
                for g, w in zip(got, want)
                for tok, pg, pw in zip(w.outputs[0].token_ids, g.outputs[0].logprobs, w.outputs[0].logprobs))
    print(f"{arch}: sampled logprobs sharded CP=2 vs one worker, largest difference {worst:.2e} of their size")
    assert worst <= 1e-4, worst


def test_a_request_that_fits_neither_way_is_refused_and_serving_goes_on(long_archs):
    prompts = _prompts(8)
    with _deployment(long_archs["mixtral"], 2, BLOCKS) as llm:
        with pytest.raises(Exception, match="attention workers hold sharded"):
            llm.generate([prompts[0]], SamplingParams(max_tokens=900, temperature=0, ignore_eos=True))
        out = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
        assert wait_until(lambda: _idle(llm), 10), _attention(llm)


def _decoding_sharded(llm) -> tuple[str, str] | None:
    """(owner, helper) once the owner decodes over the shards."""
    stats = _attention(llm)
    owner = [n for n, s in stats.items() if s.sharded_steps > 0]
    helper = [n for n, s in stats.items() if s.shards > 0]
    return (owner[0], helper[0]) if owner and helper else None


@pytest.mark.parametrize("victim", ["owner", "helper"])
def test_a_rank_lost_mid_decode_loses_no_request(long_archs, victim):
    """kill -9 the owner or the helper while the long request decodes over the shards: the worker is
    replaced, the request is prefilled again with the tokens it delivered (sharded again) and goes
    on; greedy outputs equal the fault-free run's and nothing stays held."""
    prompts = _prompts(9)
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)  # the kill lands mid-decode
    with _deployment(long_archs["mixtral"], 2, BLOCKS) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        ids = [llm.engine.add_request(p, params) for p in prompts]
        assert wait_until(lambda: _decoding_sharded(llm) is not None, 120)
        ranks = _decoding_sharded(llm)
        name = ranks[0] if victim == "owner" else ranks[1]
        os.kill(llm.engine.workers[name].pid, signal.SIGKILL)
        done, deadline = {}, time.monotonic() + 240
        while len(done) < len(ids):
            assert time.monotonic() < deadline, "generation hung"
            for o in llm.engine.get_outputs(timeout=0.5):
                if o.finished:
                    done[o.request_id] = o
        assert [done[r].error for r in ids] == [None, None]
        assert [done[r].outputs[0].token_ids for r in ids] == want
        assert llm.engine.membership.restarts == {name: 1} and llm.engine.failed is None
        assert wait_until(lambda: _idle(llm), 10), _attention(llm)


def test_an_abort_mid_decode_frees_the_shards(long_archs):
    prompts = _prompts(10)
    params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    with _deployment(long_archs["mixtral"], 2, BLOCKS) as llm:
        rid = llm.engine.add_request(prompts[0], params)
        assert wait_until(lambda: _decoding_sharded(llm) is not None, 120)
        llm.engine.abort(rid)
        assert wait_until(lambda: _idle(llm), 20), _attention(llm)
        out = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]


def test_three_ranks_fp8_prompt_logprobs_and_two_micro_batches(long_archs):
    """CP = 3 over three attention workers with an FP8 KV cache and two micro-batches, the KV kept
    sharded (``cp_kv="shard"``): the greedy tokens and prompt logprobs (within 1e-4 of their size)
    of the same deployment gathering it, and two helpers holding shards while the owner decodes."""
    rng = random.Random(13)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(n)]} for n in (1536, 30)]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=0),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)]
    over = dict(attention_workers=3, context_parallel_size=3, cp_min_tokens=512, kv_cache_dtype="fp8_e4m3",
                micro_batches=2)
    outs = {}
    for kv in ("gather", "shard"):
        with _deployment(long_archs["qwen3_moe"], 3, 300, cp_kv=kv, **over) as llm:
            outs[kv] = llm.generate(prompts, params)
            # (a helper of the gathered prompt may end its step after the owner's outputs)
            assert wait_until(lambda: sorted(s.cp_steps for s in _attention(llm).values()) == [1, 1, 1], 10)
            stats = _attention(llm)
            assert sorted(s.sharded_steps for s in stats.values()) == ([0, 0, 5] if kv == "shard" else [0, 0, 0])
            assert wait_until(lambda: _idle(llm), 10), _attention(llm)
    want, got = outs["gather"], outs["shard"]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    ids = prompts[0]["prompt_token_ids"]
    worst = max(abs(got[0].prompt_logprobs[j][ids[j]].logprob - want[0].prompt_logprobs[j][ids[j]].logprob)
                / max(1.0, abs(want[0].prompt_logprobs[j][ids[j]].logprob)) for j in range(1, len(ids)))
    assert worst < 1e-4, worst
