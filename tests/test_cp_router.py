"""The front end's part of context-parallel prefill (``afdserve.cluster.cp``), without processes: a
``ClusterClient`` whose workers record the messages sent to them. Which prompts go CP, their ranks,
pieces and handles, aborts, the owner's first output, a lost rank; the zigzag split; the options."""

from dataclasses import replace
from types import SimpleNamespace

import pytest

from afdserve.balance.attention import AttentionBalancer
from afdserve.cli.deployment import engine_config
from afdserve.cli.main import build_parser
from afdserve.cluster.client import ClusterClient
from afdserve.cluster.cp import CPRouter, cp_split
from afdserve.cluster.resize import scale
from afdserve.cluster.supervisor import MAX_CRASHES_PER_REQUEST, CrashCounts, Membership
from afdserve.cluster.worker_stats import ClusterStats
from afdserve.config import EngineConfig
from afdserve.engine.outputs import TokenOutput
from afdserve.engine.sampling_params import SamplingParams
from afdserve.errors import ConfigError, RequestError
from afdserve.kvcache.cp_split import zigzag
from afdserve.runtime.messages import (AbortRequests, AddRequest, AddRequests,
                                       AttentionStats, CPShard, StepOutputs, WorkerSpec, decode, encode)

P = SamplingParams(max_tokens=8, temperature=0.0)


class Worker:
    """A worker's control link that records what it was sent."""

    def __init__(self):
        self.sent, self.dead, self.killed, self.fail_next = [], False, False, False

    def send(self, msg):
        if self.fail_next:
            self.fail_next = False
            raise OSError("the channel broke")
        self.sent.append(msg)

    def kill(self):
        self.killed = True

    def adds(self):
        """The AddRequests it got, batches unpacked."""
        return [a for m in self.sent for a in (m.requests if isinstance(m, AddRequests) else [m])
                if isinstance(a, AddRequest)]

    def aborts(self):
        return [rid for m in self.sent if isinstance(m, AbortRequests) for rid in m.request_ids]


def cluster(attention=4, cp=2, min_tokens=64, step=2048, block=16, blocks=100_000, cp_kv="auto", max_len=1 << 20):
    """A ClusterClient over recording workers (no processes, no model); each worker's KV cache
    holds ``blocks`` blocks."""
    cfg = EngineConfig(attention_workers=attention, expert_workers=1, context_parallel_size=cp,
                       cp_min_tokens=min_tokens, max_num_batched_tokens=step, block_size=block, device="cpu",
                       num_kv_blocks=blocks, cp_kv=cp_kv)
    c = object.__new__(ClusterClient)
    c.config, c.failed, c._closed, c.can_replace, c._held = cfg, None, False, True, []
    c.attention, c.experts = [f"attention{i}" for i in range(attention)], ["expert0"]
    c.workers = {n: Worker() for n in c.attention + c.experts}
    c.specs = {n: WorkerSpec(n.rstrip("0123456789"), int(n[-1]), cfg, "", None, ("", 0), "g")
               for n in c.workers}
    c.owner, c.lengths, c.requests = {}, {}, {}
    c.crashes, c.membership, c.map_version, c.expert_map = CrashCounts(), Membership("g"), 0, None
    c.balancer, c.routes, c.pd = AttentionBalancer(list(c.attention)), None, None
    c.stats_view = ClusterStats(c.attention, c.experts, 1)
    c.model_cfg = SimpleNamespace(num_experts=8, num_layers=2, num_kv_heads=2, head_dim=8, kv_latent_dim=0,
                                  kv_window=0)
    c.max_model_len = max_len
    c._launch = lambda spec: Worker()
    c.taken = {}  # request id -> the tokens the caller took in (FrontEnd's output processor's part)
    c.delivered = lambda rid: list(c.taken.get(rid, []))
    c.cp = CPRouter(c) if cp > 1 else None
    return c


def step(c, name, *outs):
    """Worker ``name`` reports a step with these outputs; the outputs the caller gets."""
    got = c._handle(name, StepOutputs(name, list(outs), AttentionStats(0, 0, 0.0, 0.0, 0, [])))
    for o in got:
        c.taken.setdefault(o.request_id, []).extend(o.new_token_ids)
    return got


def shards(c, rid):
    """{worker: its CPShard} of the latest AddRequest of ``rid`` each worker got."""
    out = {}
    for name, w in c.workers.items():
        for a in w.adds():
            if a.request_id == rid:
                out[name] = a.cp
    return out


def clear(c):
    for w in c.workers.values():
        w.sent.clear()


# ---- the split -----------------------------------------------------------------------------------
def test_zigzag_cuts_block_aligned_chunks_and_pairs_them():
    assert zigzag(100, 2, 16) == (((0, 32), (96, 100)), ((32, 64), (64, 96)))
    assert zigzag(50, 1, 16) == (((0, 32), (32, 50)),)
    # three chunks: the owner takes the first and the last (the prompt's last token is always its)
    assert zigzag(65, 2, 16) == (((0, 32), (64, 65)), ((32, 64),))
    with pytest.raises(ValueError, match="at least 1"):
        zigzag(0, 2, 16)
    for n, N, bs in ((10_000, 4, 16), (4096, 3, 16), (777, 5, 8), (1, 2, 16)):
        pieces = zigzag(n, N, bs)
        assert len(pieces) == N
        flat = sorted(p for rank in pieces for p in rank)
        bounds = [0] + [e for _, e in flat]
        assert [s for s, _ in flat] == bounds[:-1] and bounds[-1] == n  # every position once
        assert all(s % bs == 0 and s < e for s, e in flat)
    p = zigzag(10_000, 4, 16)  # chunks of 1264, the last of 1152
    assert p[0] == ((0, 1264), (8848, 10_000)) and p[3] == ((3792, 5056), (5056, 6320))
    assert [sum(e - s for s, e in r) for r in p] == [2416, 2528, 2528, 2528]
    with pytest.raises(ValueError):
        zigzag(10, 0, 16)


def test_which_prompts_go_context_parallel():
    assert cp_split(4096, 2, 16, 4096, 2048) == zigzag(4096, 2, 16)  # each rank 2 chunks of 1024
    assert cp_split(4095, 2, 16, 4096, 2048) is None  # under cp_min_tokens
    assert cp_split(4096, 1, 16, 64, 2048) is None  # one rank
    assert cp_split(4200, 2, 16, 64, 2048) is None  # a rank's share (2 x 1056 tokens) over one step
    assert cp_split(4200, 3, 16, 64, 2048) is not None  # ... but not over three ranks
    assert cp_split(20, 2, 16, 2, 2048) is None  # two chunks, both the owner's: no share for rank 1


# ---- submission ----------------------------------------------------------------------------------
def test_a_long_prompt_goes_to_every_rank_with_its_shard_and_is_booked_on_the_owner():
    c = cluster(attention=4, cp=3)
    for w, n in (("attention0", 3), ("attention1", 1), ("attention2", 2)):  # attention3 idle
        for i in range(n):
            c.balancer.add(w, f"busy{w}{i}", 500)
    ids = list(range(380))  # chunks of 64, the last of 60
    c.submit_many([("short", ids[:63], P), ("long", ids, P)])
    assert [a.cp for a in c.workers["attention3"].adds() if a.request_id == "short"] == [None]
    assert sum(len(w.adds()) for w in c.workers.values()) == 4  # short once, long thrice
    got = shards(c, "long")
    assert set(got) == {"attention3", "attention1", "attention2"}  # owner: the least loaded; helpers: the next
    pieces = zigzag(380, 3, 16)
    for name, (rank, index) in {"attention3": (0, 3), "attention1": (1, 1), "attention2": (2, 2)}.items():
        assert got[name] == CPShard(1, rank, (3, 1, 2), pieces) and got[name].ranks[rank] == index
    add = next(a for a in c.workers["attention1"].adds() if a.request_id == "long")
    assert (add.prompt_token_ids, add.params, add.output_token_ids) == (ids, P, [])  # the whole prompt
    assert c.owner["long"] == "attention3" and c.lengths["long"] == 380
    booked = [w for w, reqs in c.balancer.lengths.items() if "long" in reqs]
    assert booked == ["attention3"]


def test_handles_increase_and_every_worker_gets_its_shards_in_handle_order():
    c = cluster(attention=3, cp=2)
    c.submit_many([(f"r{i}", list(range(200)), P) for i in range(6)])
    handles = sorted(p.handle for p in c.cp.prefilling.values())
    assert handles == [1, 2, 3, 4, 5, 6]
    for w in c.workers.values():
        mine = [a.cp.handle for a in w.adds()]
        assert mine == sorted(mine)
    c.submit_many([("later", list(range(200)), P)])
    assert c.cp.prefilling["later"].handle == 7
    owners = {c.owner[f"r{i}"] for i in range(6)}
    assert len(owners) == 3  # owners spread by load; helpers differ from their owner
    assert all(p.ranks[0] != p.ranks[1] for p in c.cp.prefilling.values())


def test_cp_off_and_not_enough_workers_leave_prompts_as_they_were():
    c = cluster(attention=2, cp=1)
    assert c.cp is None
    c.submit_many([("r", list(range(200)), P)])
    assert [a.cp for w in c.workers.values() for a in w.adds()] == [None]


# ---- cancel, outputs -----------------------------------------------------------------------------
def test_cancel_reaches_every_rank_still_prefilling_and_only_the_owner_after_its_first_output():
    c = cluster(attention=3, cp=3)
    c.submit_many([("a", list(range(380)), P), ("b", list(range(380)), P)])
    ranks_a = c.cp.prefilling["a"].ranks
    c.cancel("a")
    assert sorted(n for n, w in c.workers.items() if w.aborts() == ["a"]) == sorted(ranks_a)
    assert "a" not in c.owner and "a" not in c.cp.prefilling
    assert all("a" not in reqs for reqs in c.balancer.lengths.values())
    clear(c)
    owner = c.owner["b"]
    assert step(c, owner, TokenOutput("b", [5])) == [TokenOutput("b", [5])]  # the first token: helpers done
    assert "b" not in c.cp.prefilling and c.lengths["b"] == 381
    c.cancel("b")
    assert {n: w.aborts() for n, w in c.workers.items() if w.aborts()} == {owner: ["b"]}


def test_a_helpers_output_is_not_the_requests_and_the_owners_finish_frees_it():
    c = cluster(attention=2, cp=2)
    c.submit_many([("r", list(range(100)), replace(P, max_tokens=1))])
    owner, helper = c.cp.prefilling["r"].ranks
    assert step(c, helper, TokenOutput("r", [9])) == []
    assert "r" in c.cp.prefilling
    done = TokenOutput("r", [5], finish_reason="length")
    assert step(c, owner, done) == [done]
    assert "r" not in c.owner and "r" not in c.cp.prefilling
    assert not any(w.aborts() for w in c.workers.values())  # nothing to abort: every rank is done


def test_a_failed_submission_leaves_no_rank_holding_the_request():
    c = cluster(attention=3, cp=2)
    c.workers["attention2"].fail_next = True
    with pytest.raises(OSError):
        c.submit_many([(f"r{i}", list(range(100)), P) for i in range(3)])
    assert c.owner == {} and c.cp.prefilling == {}
    assert all(c.balancer.lengths[w] == {} for w in c.attention)
    for w in c.workers.values():  # every rank that got its shard (or was to) aborted it
        assert {a.request_id for a in w.adds()} <= set(w.aborts())
    assert sorted(c.workers["attention2"].aborts()) == ["r1", "r2"]  # a helper of r1, the owner of r2


# ---- a lost rank ---------------------------------------------------------------------------------
def test_a_lost_helper_aborts_the_prefill_on_the_other_ranks_and_submits_it_again():
    c = cluster(attention=4, cp=2)
    c.submit_many([("cp", list(range(200)), P), ("dec", list(range(20)), P)])
    owner, helper = c.cp.prefilling["cp"].ranks
    old = c.workers[helper]
    clear(c)
    c._lost(helper, "test: killed")
    assert old.killed and c.workers[helper] is not old
    assert c.workers[owner].aborts() == ["cp"]  # the lost one is not told (a new process)
    assert [(a.request_id, a.cp) for a in c.workers[helper].adds()] == [("dec", None)]  # what it decoded
    again = c.cp.prefilling["cp"]
    assert again.handle == 2 and again.attempt == 2
    got = shards(c, "cp")
    assert set(got) == set(again.ranks) and all(s.handle == 2 for s in got.values())
    assert c.owner["cp"] == again.ranks[0] != owner  # another owner: what the old one sent is stale
    assert [w for w, reqs in c.balancer.lengths.items() if "cp" in reqs] == [again.ranks[0]]
    assert step(c, owner, TokenOutput("cp", [5])) == []  # sent before its abort reached it
    assert step(c, again.ranks[0], TokenOutput("cp", [6])) == [TokenOutput("cp", [6])]
    assert step(c, owner, TokenOutput("cp", [5])) == [] and c.lengths["cp"] == 201


def test_a_lost_owner_restarts_its_prefills_and_readmits_what_it_decoded():
    c = cluster(attention=3, cp=2)
    c.submit_many([("dec", list(range(20)), P)])
    dec_owner = c.owner["dec"]
    step(c, dec_owner, TokenOutput("dec", [7]))
    step(c, dec_owner, TokenOutput("dec", [7]))
    for w in ("attention0", "attention1", "attention2"):  # make dec's owner the least loaded
        if w != dec_owner:
            c.balancer.add(w, f"x{w}", 5000)
    c.submit_many([("cp", list(range(200)), P)])
    assert c.owner["cp"] == dec_owner
    helper = c.cp.prefilling["cp"].ranks[1]
    clear(c)
    c._lost(dec_owner, "test: killed")
    assert c.workers[helper].aborts() == ["cp"]
    new = c.workers[dec_owner]
    assert [(a.request_id, a.output_token_ids, a.cp) for a in new.adds() if a.request_id == "dec"] == \
        [("dec", [7, 7], None)]  # recomputed with the tokens sent on, the usual way
    assert c.owner["cp"] == dec_owner  # the replacement is the least loaded: it owns the new attempt...
    assert len([a for w in c.workers.values() for a in w.adds() if a.request_id == "cp"]) == 2  # ... once
    assert c.cp.prefilling["cp"].handle == 2 and "dec" not in c.cp.prefilling


def test_a_prefill_ended_by_lost_ranks_too_often_goes_the_usual_way():
    c = cluster(attention=2, cp=2)
    c.submit_many([("cp", list(range(200)), P)])
    for attempt in range(1, MAX_CRASHES_PER_REQUEST):
        assert c.cp.prefilling["cp"].attempt == attempt
        lost = c.cp.prefilling["cp"].ranks[1]
        c._lost(lost, "test")
        c.membership.ready(lost)  # its replacement is up
    clear(c)
    c._lost(c.cp.prefilling["cp"].ranks[1], "test")
    assert "cp" not in c.cp.prefilling
    adds = [a for w in c.workers.values() for a in w.adds()]
    assert [(a.request_id, a.cp) for a in adds] == [("cp", None)] and c.owner["cp"] in c.attention


def test_a_resize_withdraws_the_prefills_of_leaving_ranks_and_never_goes_below_the_cp_size():
    c = cluster(attention=3, cp=2)
    with pytest.raises(ConfigError, match="context-parallel"):
        scale(c, 1, None, 1.0)
    c.submit_many([(f"r{i}", list(range(200)), P) for i in range(3)])
    hit = sorted(rid for rid, p in c.cp.prefilling.items() if "attention2" in p.ranks)
    assert hit
    withdrawn = c.cp.withdraw(["attention2"])
    assert sorted(w.request_id for w in withdrawn) == hit and all(rid not in c.owner for rid in hit)
    c.balancer.remove_worker("attention2")
    del c.attention[2:]
    clear(c)
    c.cp.resubmit(withdrawn)
    assert all(set(c.cp.prefilling[rid].ranks) == {"attention0", "attention1"} for rid in hit)
    assert not c.workers["attention2"].adds()


# ---- where the KV stays: gathered or sharded ------------------------------------------------------
def test_the_kv_is_sharded_where_the_request_does_not_fit_one_worker():
    c = cluster(attention=3, cp=2, blocks=20, max_len=560)  # a worker holds 320 tokens, a request 560
    c.submit_many([("fits", list(range(200)), P), ("big", list(range(400)), P)])
    assert {s.keep for s in shards(c, "fits").values()} == {False}
    assert {s.keep for s in shards(c, "big").values()} == {True} and c.cp.prefilling["big"].keep
    assert not c.cp.prefilling["fits"].keep
    with pytest.raises(RequestError, match="2 attention workers hold sharded"):  # the owner's 176 + 150 tokens
        c.submit_many([("huge", list(range(400)), replace(P, max_tokens=150))])
    with pytest.raises(RequestError, match="does not go context parallel"):
        c.submit_many([("short", list(range(40)), replace(P, max_tokens=400))])  # under cp_min_tokens
    assert "huge" not in c.owner and "short" not in c.owner
    for kv, keep in (("shard", True), ("gather", False)):
        c = cluster(attention=2, cp=2, cp_kv=kv)
        c.submit_many([("r", list(range(200)), P)])
        assert {s.keep for s in shards(c, "r").values()} == {keep}
    with pytest.raises(ConfigError, match="num_kv_blocks"):  # gathered, a worker must hold a whole request
        cluster(attention=2, cp=2, blocks=20, max_len=560, cp_kv="gather")


def test_a_sharded_requests_helpers_hold_their_shards_until_it_ends():
    c = cluster(attention=3, cp=3, cp_kv="shard")
    c.submit_many([("a", list(range(380)), P), ("b", list(range(380)), P)])
    (owner, *helpers), ranks_b = c.cp.prefilling["a"].ranks, c.cp.prefilling["b"].ranks
    clear(c)
    assert step(c, owner, TokenOutput("a", [5])) == [TokenOutput("a", [5])]
    assert "a" not in c.cp.prefilling and c.cp.sharded["a"].ranks[0] == owner
    assert not any(w.aborts() for w in c.workers.values())  # the helpers hold on
    done = TokenOutput("a", [6], finish_reason="length")
    assert step(c, owner, done) == [done]
    assert sorted(n for n, w in c.workers.items() if w.aborts() == ["a"]) == sorted(helpers)  # released
    assert "a" not in c.cp.sharded
    clear(c)
    step(c, ranks_b[0], TokenOutput("b", [1]))
    c.cancel("b")
    assert sorted(n for n, w in c.workers.items() if w.aborts() == ["b"]) == sorted(ranks_b)


def test_a_lost_helper_of_a_sharded_request_resubmits_it_with_its_tokens_so_far():
    c = cluster(attention=3, cp=2, cp_kv="shard")
    c.submit_many([("r", list(range(200)), P)])
    owner, helper = c.cp.prefilling["r"].ranks
    step(c, owner, TokenOutput("r", [5]))
    step(c, owner, TokenOutput("r", [6]))
    clear(c)
    c._lost(helper, "test: killed")
    assert c.workers[owner].aborts() == ["r"] and "r" not in c.cp.sharded
    again = c.cp.prefilling["r"]
    assert again.handle == 2 and again.attempt == 2 and again.keep and again.ranks[0] != owner
    adds = [a for w in c.workers.values() for a in w.adds() if a.request_id == "r"]
    assert len(adds) == 2 and all(a.output_token_ids == [5, 6] and a.cp.keep for a in adds)
    assert all(a.cp.total == 200 for a in adds)  # the prompt, prefilled again (the owner computes 5, 6 after it)
    assert step(c, owner, TokenOutput("r", [7])) == []  # the old owner's, sent before its abort


# ---- options, messages ---------------------------------------------------------------------------
def test_options_are_checked():
    ok = EngineConfig(attention_workers=3, expert_workers=1, context_parallel_size=3, cp_min_tokens=2, device="cpu")
    assert (ok.context_parallel_size, ok.cp_min_tokens) == (3, 2)
    assert (EngineConfig(device="cpu").context_parallel_size, EngineConfig(device="cpu").cp_min_tokens) == (1, 4096)
    for kw, why in ((dict(context_parallel_size=0), "context_parallel_size=0: must be an integer >= 1"),
                    (dict(context_parallel_size=2.0), "context_parallel_size=2.0: must be an integer"),
                    (dict(context_parallel_size=5), r"must be in 1..attention_workers \(4\)"),
                    (dict(cp_min_tokens=1), "cp_min_tokens=1: must be an integer >= 2"),
                    (dict(cp_kv="both"), "cp_kv=.*must be auto, gather or shard"),
                    (dict(context_parallel_size=2, prefill_workers=2, decode_workers=2, attention_workers=1),
                     "prefill/decode disaggregation")):
        with pytest.raises(ConfigError, match=why):
            EngineConfig(**{"attention_workers": 4, "expert_workers": 1, "device": "cpu", **kw})
    with pytest.raises(ConfigError, match="attention_workers"):
        EngineConfig(context_parallel_size=2, device="cpu")  # one attention worker


def test_cli_flags_reach_the_config():
    for cmd in ("serve", "generate"):
        args = build_parser().parse_args([cmd, "--attention-workers", "2", "--expert-workers", "1",
                                          "--context-parallel-size", "2", "--cp-min-tokens", "1000", "--cp-kv", "shard",
                                          "--device", "cpu"] + (["--prompt", "x"] if cmd == "generate" else []))
        cfg = engine_config(args)
        assert (cfg.context_parallel_size, cfg.cp_min_tokens, cfg.cp_kv) == (2, 1000, "shard")
    with pytest.raises(ConfigError, match="context_parallel_size"):
        engine_config(build_parser().parse_args(["serve", "--context-parallel-size", "2", "--device", "cpu"]))


def test_a_shard_travels_as_a_control_message():
    msg = AddRequest("r", [1, 2, 3], P, cp=CPShard(4, 1, (2, 0), zigzag(3, 2, 1)))
    assert decode(encode(msg)) == msg and AddRequest("r", [1], P).cp is None
