"""Predicted iteration time of a *local* deployment of this repository's runtime.

``n_a`` attention worker processes each hold ``batch_per_attention_worker`` sequences and run them
as ``m`` micro-batches; ``n_e`` expert worker processes hold ``E / n_e`` experts each.  Compute
times come from the profile's k1..k4 (TP = 1), communication from the profile's measured transport
(``latency + bytes / bandwidth`` per message, serialised per endpoint -- Eq. (6) with the measured
Util curve), and the pipeline from :func:`afdserve.planner.perf_model.iteration_time` (exactly
what the simulator gives; uneven micro-batches are simulated).

This is the prediction the accuracy benchmark compares with measured iteration times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from afdserve.planner import perf_model as pm
from afdserve.planner.profile import AttentionCost, ExpertCost, Profile
from afdserve.planner.simulator import SimConfig, simulate
from afdserve.planner.spec import ModelSpec

__all__ = ["LocalPrediction", "predict_local", "predict_iteration_time", "tokens_per_expert_worker"]


@dataclass(frozen=True)
class LocalPrediction:
    iteration_s: float  # whole decoding step, including step overhead
    pipeline_s: float  # the L layers only
    ta_s: float  # per micro-batch (largest micro-batch)
    te_s: float
    tc_a2e_s: float
    tc_e2a_s: float
    micro_batch_sizes: tuple[int, ...]
    experts_per_worker: int
    expert_cost_scaled: bool  # True when k4 was scaled from a profile entry with another expert count


def tokens_per_expert_worker(b_a: float, spec: ModelSpec, n_e: int, dispatch: str) -> float:
    """Hidden vectors one attention worker sends one expert worker for a micro-batch of ``b_a``."""
    if dispatch == "broadcast":
        return float(b_a)
    if dispatch == "pairs":
        return b_a * spec.top_k / n_e
    # routed: a token goes to a worker once if any of its K distinct experts lives there
    e = math.ceil(spec.num_experts / n_e)
    E, K = spec.num_experts, spec.top_k
    p_miss = math.comb(E - e, K) / math.comb(E, K) if E - e >= K else 0.0
    return b_a * (1.0 - p_miss)


def _attention(profile: Profile, gpu: str) -> AttentionCost:
    c = profile.attention_cost(gpu, 1) if gpu else next((a for a in profile.attention if a.tp == 1), None)
    if c is None:
        raise ValueError(f"profile has no TP=1 attention entry{' for ' + gpu if gpu else ''}")
    return c


def _expert(profile: Profile, gpu: str, experts_per_worker: int) -> tuple[ExpertCost, bool]:
    cands = [c for c in profile.expert if c.tp == 1 and (not gpu or c.gpu in ("", "*") or c.gpu.lower() == gpu.lower())]
    if not cands:
        raise ValueError(f"profile has no TP=1 expert entry{' for ' + gpu if gpu else ''}")
    exact = next((c for c in cands if c.experts_per_node == experts_per_worker), None)
    if exact is not None:
        return exact, False
    near = min(cands, key=lambda c: abs(math.log(c.experts_per_node / experts_per_worker)))
    # k4 is the weight traffic of the worker's experts: proportional to how many it holds
    return replace(
        near, k4=near.k4 * experts_per_worker / near.experts_per_node, experts_per_node=experts_per_worker
    ), True


def predict_local(
    profile: Profile,
    n_a: int,
    n_e: int,
    m: int,
    batch_per_attention_worker: int,
    seq_len: float,
    model_spec: ModelSpec,
    *,
    gpu: str = "",
) -> LocalPrediction:
    if min(n_a, n_e, m, batch_per_attention_worker) < 1:
        raise ValueError("n_a, n_e, m and batch_per_attention_worker must be >= 1")
    if profile.network is None:
        raise ValueError("profile has no network section (measured transport latency/bandwidth)")
    spec, net, wire = model_spec, profile.network, profile.wire
    att = _attention(profile, gpu)
    epw = math.ceil(spec.num_experts / n_e)
    exp, scaled = _expert(profile, gpu, epw)

    b = batch_per_attention_worker
    mm = min(m, b)
    sizes = tuple(b // mm + (1 if i < b % mm else 0) for i in range(mm))
    util = net.util_curve()
    w = net.nominal
    ta, te, tc_f, tc_b = [], [], [], []
    for b_a in sizes:
        ta.append(att.time(b_a, seq_len))
        te.append(exp.time(pm.expert_micro_batch(b_a, n_a, spec.top_k, n_e)))
        tok = tokens_per_expert_worker(b_a, spec, n_e, wire.dispatch)
        fwd = tok * (spec.hidden_size * wire.act_bytes + wire.meta_bytes_per_token)
        back = tok * spec.hidden_size * wire.act_bytes
        # every attention worker sends n_e messages; every expert worker receives n_a
        tc_f.append(pm.comm_time(fwd * n_e, n_e, w, fwd * n_a, n_a, w, util))
        tc_b.append(pm.comm_time(back * n_a, n_a, w, back * n_e, n_e, w, util))
    L = spec.num_layers
    if len(set(sizes)) == 1:
        pipe = pm.iteration_time(ta[0], te[0], tc_f[0], mm, L, tc_back=tc_b[0])
    else:  # uneven micro-batches: simulate with per-micro-batch times (comm: the largest)
        pipe = simulate(
            SimConfig(n_a=n_a, n_e=n_e, micro_batches=mm, num_layers=L, ta=ta, te=te, tc=max(tc_f), tc_back=max(tc_b))
        ).iteration_time
    step = profile.step_fixed_s + profile.step_per_token_s * b
    return LocalPrediction(
        iteration_s=pipe + step,
        pipeline_s=pipe,
        ta_s=max(ta),
        te_s=max(te),
        tc_a2e_s=max(tc_f),
        tc_e2a_s=max(tc_b),
        micro_batch_sizes=sizes,
        experts_per_worker=epw,
        expert_cost_scaled=scaled,
    )


def predict_iteration_time(
    profile: Profile,
    n_a: int,
    n_e: int,
    m: int,
    batch_per_attention_worker: int,
    seq_len: float,
    model_spec: ModelSpec,
) -> float:
    """Seconds per decoding iteration of the local runtime (see :func:`predict_local`)."""
    return predict_local(profile, n_a, n_e, m, batch_per_attention_worker, seq_len, model_spec).iteration_s
