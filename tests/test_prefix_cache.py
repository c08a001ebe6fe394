"""Automatic prefix caching: chain keys, block sharing by reference count, LRU eviction, preemption,
and greedy outputs identical with and without the cache."""

import random
import subprocess
import sys

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.engine.engine import Engine
from afdserve.engine.runner import ModelOutput
from afdserve.engine.scheduler import SchedulerConfig
from afdserve.kvcache.block_manager import BlockManager
from afdserve.kvcache.prefix import PrefixCacheConfig, block_hashes

BS = 4
SALT = b"test-salt"
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _bm(n=8):
    return BlockManager(n, BS, PrefixCacheConfig(SALT))


def _run(bm, seq_id, tokens, computed=None):
    """Admits a sequence as the scheduler does; returns its cached tokens."""
    keys = block_hashes(tokens, BS, SALT)
    hit = bm.lookup(keys, (len(tokens) - 1) // BS)
    assert bm.can_admit(hit, len(tokens))
    cached = bm.acquire(seq_id, hit, len(tokens))
    bm.reserve(seq_id, len(tokens))
    bm.commit(seq_id, keys, len(tokens) if computed is None else computed)
    return cached


def test_chain_keys_cover_the_whole_prefix_and_salt():
    a = block_hashes(list(range(12)), BS, SALT)
    assert len(a) == 3 and len(block_hashes(list(range(11)), BS, SALT)) == 2  # full blocks only
    b = block_hashes([99] + list(range(1, 12)), BS, SALT)
    assert a[0] != b[0] and a[1] != b[1] and a[2] != b[2]  # a change early changes every later key
    assert block_hashes(list(range(12)), BS, b"other") != a
    assert block_hashes(list(range(4, 12)), BS, SALT, parent=a[0]) == a[1:]  # continues a chain
    code = "from afdserve.kvcache.prefix import block_hashes; print(block_hashes(list(range(12)), 4, b'test-salt')[2].hex())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == a[2].hex()  # the same in another process (no Python hash())


def test_sharing_reference_counts_and_at_least_one_token_computed():
    bm = _bm()
    p = list(range(10))
    assert _run(bm, 1, p) == 0
    t1 = list(bm.tables[1])
    assert _run(bm, 2, p + [50, 51]) == 8  # two full blocks shared
    assert bm.tables[2][:2] == t1[:2] and bm.refs[t1[0]] == 2
    assert _run(bm, 3, p[:8]) == 4  # a whole-block prompt still computes its last block
    bm.free(1)
    assert bm.refs[t1[0]] == 2
    bm.free(2), bm.free(3)
    assert bm.refs[t1[0]] == 0 and bm.num_free == 8 and len(bm.cached) == 3  # + the 3rd block of request 2
    s = bm.stats()
    assert (s.query_requests, s.hit_requests, s.hit_tokens, s.query_tokens) == (3, 2, 12, 30)


def test_unreferenced_blocks_evicted_lru_only_when_free_blocks_run_out():
    bm = _bm(6)
    _run(bm, 1, list(range(8)) + [0])  # 3 blocks, 2 cached keys
    bm.free(1)
    _run(bm, 2, list(range(100, 108)) + [0])
    bm.free(2)
    assert len(bm.cached) == 4 and bm.stats().device_evictions == 0
    # 3 new blocks: the 2 uncached free blocks first, then the least recently released cached one
    _run(bm, 3, list(range(200, 211)))
    assert bm.stats().device_evictions == 1
    keys1 = block_hashes(list(range(8)), BS, SALT)
    keys2 = block_hashes(list(range(100, 108)), BS, SALT)
    assert keys2[0] in bm.cached and keys2[1] in bm.cached  # the more recent prompt survives
    hit = bm.lookup(keys1, 2)
    assert len(hit.device) == 1  # first block of request 1 kept (its last block went first)
    assert not bm.lookup([keys1[1]], 1).device or keys1[0] in bm.cached


def test_partial_blocks_and_uncomputed_blocks_are_not_cached():
    bm = _bm()
    p = list(range(10))
    keys = block_hashes(p, BS, SALT)
    hit = bm.lookup(keys, 2)
    bm.acquire(1, hit, len(p))
    bm.reserve(1, 6)
    bm.commit(1, keys, 6)  # chunked prefill: 6 of 10 computed -> 1 full block
    assert len(bm.cached) == 1
    bm.reserve(1, 10)
    bm.commit(1, keys, 10)
    assert len(bm.cached) == 2


def test_duplicate_blocks_keep_the_first():
    bm = _bm()
    p = list(range(9))
    keys = block_hashes(p, BS, SALT)
    for sid in (1, 2):  # both admitted before either is computed
        bm.acquire(sid, bm.lookup(keys, 2), 9)
        bm.reserve(sid, 9)
    bm.commit(1, keys, 9)
    bm.commit(2, keys, 9)
    assert bm.cached[keys[0]] == bm.tables[1][0]
    bm.free(1), bm.free(2)
    assert bm.num_free == 8 and len(bm.cached) == 2


def _prompts(n, shared, seed=0):
    rng = random.Random(seed)
    base = [rng.randrange(3, 256) for _ in range(shared)]
    return [base + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 20))] for _ in range(n)]


def _gen(llm, ps, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]


@pytest.fixture(scope="module")
def reference(tiny_mixtral):
    ps = _prompts(6, 37) + _prompts(3, 50, seed=1)
    with LLM(str(tiny_mixtral), num_kv_blocks=64, enable_prefix_caching=False) as llm:
        return ps, [_gen(llm, [p])[0] for p in ps]


def test_greedy_outputs_identical_with_cache_and_chunked_prefill(tiny_mixtral, reference):
    ps, ref = reference
    with LLM(str(tiny_mixtral), num_kv_blocks=64, max_num_batched_tokens=24) as llm:
        one_by_one = [_gen(llm, [p])[0] for p in ps]
        batched = _gen(llm, ps)
        again = _gen(llm, ps)
        s = llm.engine.engine.prefix_stats()
        assert llm.engine.engine.blocks.num_free == 64
    assert one_by_one == ref and batched == ref and again == ref
    assert s.hit_requests >= len(ps) and s.hit_tokens > 0


def test_preemption_keeps_blocks_cached_and_outputs_identical(tiny_mixtral, reference):
    ps, ref = reference
    with LLM(str(tiny_mixtral), num_kv_blocks=12, block_size=16, max_model_len=128) as llm:
        eng = llm.engine.engine
        preempted = []
        orig = eng.scheduler._preempt

        def spy(seq, batch):
            preempted.append(seq.request_id)
            orig(seq, batch)

        eng.scheduler._preempt = spy
        got = _gen(llm, ps)
        assert eng.blocks.num_free == 12
        assert sum(eng.blocks.refs) == 0
    assert got == ref
    assert preempted, "the test should exercise preemption"


def test_prompt_logprobs_are_computed_not_skipped(tiny_mixtral, reference):
    ps, _ = reference
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1, ignore_eos=True)
    with LLM(str(tiny_mixtral), num_kv_blocks=64, enable_prefix_caching=False) as llm:
        ref = llm.generate([{"prompt_token_ids": ps[0]}], params)[0].prompt_logprobs
    with LLM(str(tiny_mixtral), num_kv_blocks=64) as llm:
        _gen(llm, ps[:1])  # caches the prompt
        got = llm.generate([{"prompt_token_ids": ps[0]}], params)[0].prompt_logprobs
    assert len(got) == len(ref) == len(ps[0])
    for a, b in zip(got[1:], ref[1:]):
        assert set(a) == set(b)
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) < 1e-4


def test_no_leak_after_many_requests(tiny_mixtral):
    rng = random.Random(5)
    bases = [[rng.randrange(3, 256) for _ in range(rng.randrange(16, 60))] for _ in range(5)]
    with LLM(str(tiny_mixtral), num_kv_blocks=24, block_size=8, max_model_len=128) as llm:
        eng = llm.engine.engine
        for _ in range(6):
            ps = [rng.choice(bases) + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
            _gen(llm, ps, SamplingParams(max_tokens=rng.randrange(1, 8), temperature=0, ignore_eos=True))
        s = eng.prefix_stats()
        assert eng.blocks.num_free == 24 and sum(eng.blocks.refs) == 0 and not eng.blocks.tables
        assert len(eng.blocks.cached) <= 24 and s.device_evictions > 0 and s.hit_tokens > 0
        assert set(eng.blocks.cached.values()) <= set(range(24))
        assert all(eng.blocks.key_of[b] == k for k, b in eng.blocks.cached.items())


def test_disaggregated_attention_worker_caches_and_matches(tiny_mixtral, reference):
    ps, ref = reference
    with LLM(str(tiny_mixtral), num_kv_blocks=64, expert_workers=1, micro_batches=2) as llm:
        first = _gen(llm, ps)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    assert first == ref and [o.outputs[0].token_ids for o in outs] == ref
    assert all(o.num_cached_tokens >= 32 for o in outs)  # the worker served the prefixes from its cache


def test_every_full_block_is_registered_when_filled_by_prefill_chunks_or_decode_steps():
    """After every step, each running sequence's full computed blocks are registered, whether a
    chunk of a prefill or a decode step filled them (a decode step registers one only where it
    fills a block), with one step in flight or two (lanes)."""
    rng = random.Random(3)
    bm = _bm(48)
    eng = Engine(None, bm, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=7), 64, {2})
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i in range(4):
        eng.add_request(str(i), [rng.randrange(3, 256) for _ in range(rng.randrange(3, 15))], params)
    steps = 0
    while eng.has_unfinished():
        lanes = 2 if steps % 5 < 3 else 1  # sometimes two steps in flight, sometimes one
        inflight = [s for s in (eng.begin(lanes) for _ in range(lanes)) if s is not None]
        for s in inflight:
            eng.finish(s, ModelOutput(token_ids=torch.tensor([rng.randrange(3, 256) for _ in s.sampled], dtype=torch.int64)))
        for seq in eng.scheduler.running:
            keys = block_hashes(seq.token_ids, BS, SALT)[: seq.num_computed // BS]
            assert all(bm.cached.get(k) is not None for k in keys), (seq.request_id, seq.num_computed)
        steps += 1
    assert steps > 20
