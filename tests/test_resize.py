"""Resizing the pools while serving: expert workers and attention workers added and removed mid-decode,
experts re-placed by the balance planner, a removed attention worker's requests moved; no request
fails and greedy outputs equal the fault-free run."""

import os

import pytest

from afdserve import LLM, SamplingParams
from afdserve.errors import ConfigError


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_pools_resize_while_serving(tiny_mixtral):
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(4)]
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    llm = LLM(str(tiny_mixtral), num_kv_blocks=128, attention_workers=2, expert_workers=1, micro_batches=2)
    eng = llm.engine
    try:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        # (tokens every request has before the change, attention workers, expert workers)
        plan = [(10, None, 2), (40, 1, None), (70, 2, None), (100, None, 1), (130, None, 3)]
        ids = [eng.add_request(p, params) for p in prompts]
        got: dict[str, list[int]] = {r: [] for r in ids}
        done: set[str] = set()
        removed_pids, results = [], []
        while len(done) < len(ids):
            for o in eng.get_outputs(timeout=1.0):
                assert o.error is None, o.error
                got[o.request_id] = list(o.outputs[0].token_ids)
                if o.finished:
                    done.add(o.request_id)
            if plan and min(len(t) for t in got.values()) >= plan[0][0]:
                _, n_a, n_e = plan.pop(0)
                before = dict(eng.workers)
                if n_a == 1:  # the removed attention worker has requests to move
                    assert "attention1" in eng.owner.values()
                results.append(eng.scale(attention_workers=n_a, expert_workers=n_e))
                removed_pids += [w.pid for n, w in before.items() if n not in eng.workers]
        assert not plan, "generation ended before every resize happened"
        assert [got[r] for r in ids] == want
        assert [(r.attention_workers, r.expert_workers) for r in results] == [(2, 2), (1, 2), (2, 2), (2, 1), (2, 3)]
        assert [r.epoch for r in results] == [1, 2, 3, 4, 5]
        assert results[-1].map_version == 3  # the map changed with each expert-pool change
        held = [set(e) for layer in zip(*results[-1].experts_per_worker) for e in layer]
        assert all(held), "every expert worker holds experts"
        assert sorted(eng.workers) == ["attention0", "attention1", "expert0", "expert1", "expert2"]
        assert eng.membership.restarts == {} and eng.failed is None
        assert len(eng.membership.resize_seconds) == 5
        assert not any(_alive(p) for p in removed_pids)
        st = eng.stats()
        assert set(st.workers) == set(eng.workers) and set(st.workers.values()) == {"up"}
        # serving goes on, on every worker of the new membership
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
        assert all(s.tokens_per_expert_worker for s in eng.worker_stats().values() if hasattr(s, "running"))
        with pytest.raises(ConfigError, match="expert_workers"):
            eng.scale(expert_workers=10_000)
        with pytest.raises(ConfigError, match="attention_workers"):
            eng.scale(attention_workers=0)
        pids = [w.pid for w in eng.workers.values()]
    finally:
        llm.shutdown()
    assert not any(_alive(p) for p in pids)
