"""Predicted iteration time of a *local* deployment of this repository's runtime.

``n_a`` attention worker processes each hold ``batch_per_attention_worker`` sequences and run them
as ``m`` micro-batches; ``n_e`` expert worker processes hold ``E / n_e`` experts each.  Two methods:

* ``"runtime"`` (used when the profile has a ``runtime`` section, i.e. it was measured by
  ``afdserve profile``): a discrete-event simulation of the runtime's own control flow
  (:func:`afdserve.planner.runtime_sim.simulate_runtime`) with attention ``Ta = k1(s)*b + k2``,
  experts ``Te = k3*b_e + k4``, the step overhead ``step.fixed_s + step.per_token_s * b`` and the
  profile's runtime costs; micro-batches split as the runtime splits them
  (:func:`afdserve.config.micro_batch_sizes`).  CPU time-sharing, wake-ups and the slowdown of
  workers computing at once are modelled from measurements, not fudged.
* ``"analytic"``: the paper's pipeline model -- compute from k1..k4 (TP = 1), communication from the
  measured transport (``latency + bytes / bandwidth`` per message, serialised per endpoint -- Eq. (6)
  with the measured Util curve) as a pure delay, and
  :func:`afdserve.planner.perf_model.iteration_time` (exactly what the simulator gives; uneven
  micro-batches are simulated).  It assumes workers do not slow each other down.

This is the prediction the accuracy benchmark (``benchmarks/planner_accuracy.py``) compares with
measured iteration times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from afdserve.config import micro_batch_sizes
from afdserve.planner import perf_model as pm
from afdserve.planner.costs import AttentionCost, ExpertCost, interp_extend
from afdserve.planner.profile import Profile
from afdserve.planner.runtime_sim import RuntimeSim, pinned_round_robin, simulate_runtime
from afdserve.planner.simulator import SimConfig, simulate
from afdserve.planner.spec import ModelSpec

__all__ = ["LocalPrediction", "predict_local", "predict_colocated", "predict_iteration_time", "tokens_per_expert_worker"]


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
    method: str = "analytic"  # "analytic" (Eq. 5 pipeline), "runtime" (simulated runtime) or "colocated"
    busy: tuple[float, ...] = ()  # runtime method: CPU busy fraction of each worker (attention first)


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


def _expert_points(profile: Profile, experts_per_worker: int) -> tuple[tuple[float, float], ...]:
    """The profile's measured ``(pairs, seconds)`` of a worker holding ``experts_per_worker`` experts
    (``samples["expert"]`` of ``afdserve profile``), or () when it has fewer than two."""
    rows = [(r[1], r[2]) for r in (profile.samples or {}).get("expert", ()) if int(r[0]) == experts_per_worker]
    return tuple(sorted(rows)) if len(rows) >= 2 else ()


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
    method: str = "auto",
    pinned: bool = False,
) -> LocalPrediction:
    """Predicted decoding step of a local deployment (see the module docstring for ``method``:
    ``"auto"`` is ``"runtime"`` when the profile has runtime costs, else ``"analytic"``).

    ``n_e = 0`` is the colocated engine (:func:`predict_colocated`; ``n_a``, ``m`` are ignored).

    ``pinned`` (runtime method): the worker processes are pinned to the profile's cores round-robin
    (attention workers first; :func:`pinned_round_robin`) instead of being balanced by the OS."""
    if n_e == 0:
        return predict_colocated(profile, batch_per_attention_worker, seq_len, model_spec, gpu=gpu)
    if min(n_a, n_e, m, batch_per_attention_worker) < 1:
        raise ValueError("n_a, n_e, m and batch_per_attention_worker must be >= 1")
    if method not in ("auto", "runtime", "analytic"):
        raise ValueError(f"method must be auto, runtime or analytic, got {method!r}")
    if method == "auto":
        method = "runtime" if profile.runtime is not None else "analytic"
    if method == "runtime" and profile.runtime is None:
        raise ValueError("method='runtime' needs a profile with runtime costs (measured by afdserve profile)")
    if profile.network is None and method == "analytic":
        raise ValueError("profile has no network section (measured transport latency/bandwidth)")
    spec, net, wire = model_spec, profile.network, profile.wire
    att = _attention(profile, gpu)
    epw = math.ceil(spec.num_experts / n_e)
    exp, scaled = _expert(profile, gpu, epw)

    b = batch_per_attention_worker
    sizes = tuple(micro_batch_sizes(b, m))  # the runtime's split, for both methods
    step = profile.step_fixed_s + profile.step_per_token_s * b
    lm_head = sum(profile.runtime.lm_head_time(x) for x in sizes) if profile.runtime is not None else 0.0
    ta = [att.time(b_a, seq_len) for b_a in sizes]
    pairs = [pm.expert_micro_batch(b_a, 1, spec.top_k, n_e) for b_a in sizes]  # from one attention worker
    toks = [tokens_per_expert_worker(b_a, spec, n_e, wire.dispatch) for b_a in sizes]
    fwd = [t * (spec.hidden_size * wire.act_bytes + wire.meta_bytes_per_token) for t in toks]
    back = [t * spec.hidden_size * wire.act_bytes for t in toks]
    if method == "runtime":
        rt = profile.runtime
        assert rt is not None
        # every lane's step pays the step overhead of its micro-batch (runtime/lanes.py)
        lane_steps = tuple(profile.step_fixed_s + profile.step_per_token_s * x for x in sizes)
        sim = simulate_runtime(RuntimeSim(
            n_a=n_a, n_e=n_e, num_layers=spec.num_layers, micro_batches=sizes, ta=tuple(ta),
            te_per_pair=exp.k3, te_fixed=exp.k4, pairs=tuple(pairs), tokens=tuple(toks), fwd_bytes=tuple(fwd),
            back_bytes=tuple(back), step_overhead=lane_steps, costs=rt,
            affinity=pinned_round_robin(n_a, n_e, rt.cores) if pinned else None,
            begin=tuple(rt.begin_time(x) for x in sizes), te_points=_expert_points(profile, epw)))
        te = [exp.time(p * n_a) for p in pairs]
        return LocalPrediction(
            iteration_s=sim.step_s,
            pipeline_s=sim.step_s - sum(lane_steps) - lm_head,
            ta_s=max(ta) + (n_e - 1) * rt.dispatch_per_worker_s,
            te_s=max(te),
            tc_a2e_s=rt.send_time(max(fwd)) + rt.take_s,
            tc_e2a_s=rt.send_time(max(back)) + rt.take_s,
            micro_batch_sizes=sizes,
            experts_per_worker=epw,
            expert_cost_scaled=scaled,
            method="runtime",
            busy=sim.busy,
        )

    assert net is not None
    util = net.util_curve()
    w = net.nominal
    te, tc_f, tc_b = [], [], []
    for k, b_a in enumerate(sizes):
        te.append(exp.time(pm.expert_micro_batch(b_a, n_a, spec.top_k, n_e)))
        # every attention worker sends n_e messages; every expert worker receives n_a
        tc_f.append(pm.comm_time(fwd[k] * n_e, n_e, w, fwd[k] * n_a, n_a, w, util))
        tc_b.append(pm.comm_time(back[k] * n_a, n_a, w, back[k] * n_e, n_e, w, util))
    L = spec.num_layers
    mm = len(sizes)
    if len(set(sizes)) == 1:
        pipe = pm.iteration_time(ta[0], te[0], tc_f[0], mm, L, tc_back=tc_b[0])
    else:  # uneven micro-batches: simulate with per-micro-batch times (comm: the largest)
        pipe = simulate(
            SimConfig(n_a=n_a, n_e=n_e, micro_batches=mm, num_layers=L, ta=ta, te=te, tc=max(tc_f), tc_back=max(tc_b))
        ).iteration_time
    return LocalPrediction(
        iteration_s=pipe + step + lm_head,
        pipeline_s=pipe,
        ta_s=max(ta),
        te_s=max(te),
        tc_a2e_s=max(tc_f),
        tc_e2a_s=max(tc_b),
        micro_batch_sizes=sizes,
        experts_per_worker=epw,
        expert_cost_scaled=scaled,
    )


def predict_colocated(profile: Profile, batch: int, seq_len: float, model_spec: ModelSpec, *,
                      gpu: str = "") -> LocalPrediction:
    """The colocated engine (``expert_workers=0``: attention and every expert in one process, one
    thread): per step its overhead, ``L`` layers of attention (``Ta``: the profile's colocated layer
    outside its experts where measured) and all the experts over the batch's ``b * K`` pairs (``Te``
    of a worker holding all ``E``, interpolated between the measured points where the profile has
    them), and the LM head."""
    if batch < 1:
        raise ValueError("batch must be >= 1")
    spec, rt = model_spec, profile.runtime
    # the layer outside its experts: measured without the dispatch where the profile has it
    ta = rt.colocated_attention_time(batch, seq_len) if rt is not None and rt.colocated_attention_time(1, 1) > 0 else \
        _attention(profile, gpu).time(batch, seq_len)
    exp, scaled = _expert(profile, gpu, spec.num_experts)
    points = _expert_points(profile, spec.num_experts)
    te = interp_extend(points, batch * spec.top_k) if points else exp.time(batch * spec.top_k)
    lm_head = rt.lm_head_time(batch) if rt is not None else 0.0
    layers = spec.num_layers * (ta + te)
    step = profile.step_fixed_s + profile.step_per_token_s * batch
    return LocalPrediction(iteration_s=layers + lm_head + step, pipeline_s=layers, ta_s=ta, te_s=te, tc_a2e_s=0.0,
                           tc_e2a_s=0.0, micro_batch_sizes=(batch,), experts_per_worker=spec.num_experts,
                           expert_cost_scaled=scaled, method="colocated", busy=(1.0,))


def predict_iteration_time(
    profile: Profile,
    n_a: int,
    n_e: int,
    m: int,
    batch_per_attention_worker: int,
    seq_len: float,
    model_spec: ModelSpec,
    *,
    method: str = "auto",
    pinned: bool = False,
) -> float:
    """Seconds per decoding iteration of the local runtime (see :func:`predict_local`)."""
    return predict_local(profile, n_a, n_e, m, batch_per_attention_worker, seq_len, model_spec,
                         method=method, pinned=pinned).iteration_s
