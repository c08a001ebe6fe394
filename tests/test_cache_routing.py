"""Cache-aware routing in the front end of a cluster: the record of prompt blocks per attention
worker, the balancer's trade-off between a cached prefix and load, and a 2-attention-worker cluster
where a repeated prefix lands on the worker that holds it (and is served from its cache); a cancel
mid-prefill frees the worker's blocks."""

import pytest

from afdserve.balance.attention import AttentionBalancer
from afdserve.cluster import build_client
from afdserve.cluster.prefix_routing import PrefixRecord
from afdserve.config import EngineConfig
from afdserve.engine.sampling_params import SamplingParams
from afdserve.serving.metrics import ServingMetrics
from tiny_models import make_checkpoint

BS = 16


def test_record_matches_longest_prefix_and_is_bounded():
    rec = PrefixRecord(["a0", "a1"], BS, b"salt", capacity_blocks=8)
    p = list(range(100))
    rec.add("a1", rec.key(p))  # 6 full blocks
    assert rec.match(rec.key(p[:64] + [7] * 40)) == {"a0": 0, "a1": 64}
    assert rec.match(rec.key([9] + p[1:])) == {"a0": 0, "a1": 0}  # the chain: a different first token
    assert PrefixRecord(["a0"], BS, b"other", 8).key(p) != rec.key(p)  # the salt is in every key
    rec.add("a1", rec.key([5] * 64))  # 4 more blocks: the oldest 2 of p go
    assert rec.match(rec.key(p))["a1"] == 0 and len(rec.keys["a1"]) == 8
    rec.forget("a1")
    assert rec.match(rec.key([5] * 64)) == {"a0": 0, "a1": 0}
    with pytest.raises(ValueError):
        PrefixRecord(["a0"], BS, b"s", 0)


def test_balancer_prefers_the_cached_prefix_within_the_slack():
    bal = AttentionBalancer(["a0", "a1"])
    assert bal.pick(1000, 10) == "a0"  # idle: the first
    assert bal.pick(1000, 10, {"a0": 0, "a1": 512}) == "a1"  # idle: the cached prefix
    bal.add("a1", "r1", 200)  # a1 a little busier: still within the slack
    assert bal.pick(1000, 10, {"a0": 0, "a1": 512}) == "a1"
    for i in range(4):  # a1 far busier: its cached prefix no longer pays
        bal.add("a1", f"x{i}", 2000)
    assert bal.pick(1000, 10, {"a0": 0, "a1": 512}) == "a0"
    assert bal.pick(1000, 10, {"a0": 0, "a1": 0}) == "a0"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("mixtral_route"), "mixtral", max_position_embeddings=4096)
    client = build_client(EngineConfig(model=str(path), num_kv_blocks=256, attention_workers=2, expert_workers=1,
                                       micro_batches=1, max_num_batched_tokens=64, max_model_len=4096))
    yield client
    client.shutdown()


def _run(client, rids):
    """Outputs until every request in ``rids`` finished: {rid: final RequestOutput}."""
    final = {}
    while len(final) < len(rids):
        for o in client.get_outputs(0.5):
            if o.finished:
                final[o.request_id] = o
    return final


def test_repeated_prefix_lands_on_its_worker(cluster):
    c = cluster
    prefix = [(i * 13) % 200 + 3 for i in range(320)]
    busy = c.add_request({"prompt_token_ids": [4] * 40}, SamplingParams(max_tokens=30, ignore_eos=True))
    first = c.add_request({"prompt_token_ids": prefix + [5, 6, 7]}, SamplingParams(max_tokens=2))
    owner = c.owner[first]
    assert c.owner[busy] != owner  # the least loaded worker took it
    assert _run(c, [busy, first])[first].num_cached_tokens == 0
    # both idle now: without the record the balancer would pick the other (first) worker
    again = c.add_request({"prompt_token_ids": prefix + [8, 9]}, SamplingParams(max_tokens=2))
    assert c.owner[again] == owner
    assert _run(c, [again])[again].num_cached_tokens == 320  # served from that worker's cache
    other = c.add_request({"prompt_token_ids": [11] * 200}, SamplingParams(max_tokens=2))
    assert c.owner[other] != owner  # no cached prefix anywhere: the balancer's usual choice
    _run(c, [other])


def test_cancel_mid_prefill_frees_the_workers_blocks(cluster):
    c = cluster
    rid = c.add_request({"prompt_token_ids": [(i * 7) % 250 + 3 for i in range(3000)]}, SamplingParams(max_tokens=4))
    progress = None
    while progress is None or progress.done < 3 * 64:
        outs = [o for o in c.get_outputs(0.5) if o.request_id == rid]
        if outs:
            assert not outs[-1].outputs[0].token_ids
            progress = outs[-1].prefill
    assert progress.total == 3000 and progress.done < 3000
    c.abort(rid)
    stats = c.worker_stats()  # answered after the abort, which the worker takes in between two steps
    assert all(s.kv_usage == 0 for name, s in stats.items() if name.startswith("attention")), stats


def test_prefix_cache_stats_per_worker(cluster):
    c = cluster
    c.worker_stats()  # the replies carry each attention worker's prefix cache
    caches = c.stats().prefix_cache
    assert sorted(caches) == ["attention0", "attention1"] and all(s.enabled for s in caches.values())
    assert sum(s.hit_tokens for s in caches.values()) >= 320  # the repeated prefix, above
    text = ServingMetrics(c.stats, lambda: 0).render().decode()
    for w in caches:
        assert f'afdserve_prefix_cache_hit_rate{{worker="{w}"}}' in text
