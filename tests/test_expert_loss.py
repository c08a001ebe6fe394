"""--on-expert-loss: while a lost expert worker is replaced, the others serve around it -- tokens of
replicated experts go to a replica (outputs unchanged), with "drop" the others' experts take over
top-(K-1) (counted) -- and then the replacement rejoins; no request fails."""

import os
import signal

import torch

from afdserve import LLM, SamplingParams
from afdserve.balance.placement import LayerPlacement, Placement
from afdserve.runtime.expert_map import ExpertMap
from afdserve.runtime.dispatch import renormalized_weights


def _run_through_kill(llm, prompts, params, victim):
    """Generates ``prompts``, killing ``victim`` once every request has tokens; the final token ids."""
    eng = llm.engine
    ids = [eng.add_request(p, params) for p in prompts]
    got, done, killed = {r: 0 for r in ids}, {}, False
    while len(done) < len(ids):
        for o in eng.get_outputs(timeout=1.0):
            assert o.error is None, o.error
            got[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
        if not killed and min(got.values()) >= 5:
            os.kill(eng.workers[victim].pid, signal.SIGKILL)
            killed = True
    assert killed
    eng.settle(120)
    return [done[r] for r in ids]


def test_drop_then_replicas(tiny_mixtral):
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(4)]
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    llm = LLM(str(tiny_mixtral), num_kv_blocks=128, attention_workers=1, expert_workers=2, micro_batches=2,
              on_expert_loss="drop")
    eng = llm.engine
    try:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        # drop: expert1's experts have no replica; its tokens go top-(K-1) to the others meanwhile
        out = _run_through_kill(llm, prompts, params, "expert1")
        assert [len(t) for t in out] == [300] * 4
        dropped = eng.stats().dropped_expert_assignments
        assert dropped > 0
        assert eng.membership.epoch == 2 and eng.membership.restarts == {"expert1": 1}  # degraded, then rejoined
        assert set(eng.stats().workers.values()) == {"up"}
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want  # all experts back
        # every expert on both workers: a lost worker's tokens go to the replicas, nothing dropped, same outputs
        every = LayerPlacement(6, (tuple(range(6)), tuple(range(6))))
        eng.rebalance(placement=Placement(tuple(every for _ in range(eng.model_cfg.num_layers))))
        assert _run_through_kill(llm, prompts, params, "expert0") == want
        assert eng.stats().dropped_expert_assignments == dropped
        assert eng.membership.epoch == 4 and eng.membership.restarts == {"expert1": 1, "expert0": 1}
    finally:
        llm.shutdown()


def test_top_k_minus_one_weights_and_the_degraded_map():
    w = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    keep = torch.tensor([[True, False], [True, True], [False, False]])
    assert torch.allclose(renormalized_weights(w, keep), torch.tensor([[1.0, 0.0], [0.7, 0.3], [0.0, 0.0]]))
    full = ExpertMap(Placement((LayerPlacement(4, ((0, 1, 2), (2, 3))),)))
    degraded = full.without({1})
    assert degraded.lost_experts().tolist() == [[False, False, False, True]]  # expert 3 only on worker 1
    assert degraded.route(0, torch.tensor([[2, 0]])).tolist() == [[0, 0]]  # expert 2's replica on worker 0
