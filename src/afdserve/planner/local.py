"""Predicted iteration time of a *local* deployment of this repository's runtime.

``n_a`` attention worker processes each hold ``batch_per_attention_worker`` sequences and run them
as ``m`` micro-batches; ``n_e`` expert worker processes hold ``E / n_e`` experts each.  Two methods:

* ``"runtime"`` (used when the profile has a ``runtime`` section, i.e. it was measured by
  ``afdserve profile``): a discrete-event simulation of the runtime's own control flow
  (:func:`simulate_runtime`).  Each attention worker runs, per step, for every layer and micro-batch
  ``combine`` of the previous layer (one blocking ``recv`` per expert worker), attention
  (``Ta = k1(s)*b + k2``) and ``dispatch`` (one ``send`` per expert worker); after the last layer,
  per micro-batch, the combine and its LM head (``runtime.lm_head_*``); then the step overhead
  (``step.fixed_s + step.per_token_s * b``); each expert worker loops ``gather`` (the next message of
  every attention worker that has one), runs the experts once per layer present over the merged
  tokens (``Te = k3*b_e + k4``) and sends each sender its partial sums.  Sends and takes cost the
  measured CPU time, a receiver asleep in ``poll`` wakes up after ``wake_s``, when more workers
  are runnable than the profile's ``cores`` they share the cores equally (processor sharing), and
  while two cores compute at once each worker runs the measured ``corun_*`` factor slower (shared
  cache and memory bandwidth): CPU time-sharing is modelled from measurements, not fudged.
* ``"analytic"``: the paper's pipeline model -- compute from k1..k4 (TP = 1), communication from the
  measured transport (``latency + bytes / bandwidth`` per message, serialised per endpoint -- Eq. (6)
  with the measured Util curve) as a pure delay, and
  :func:`afdserve.planner.perf_model.iteration_time` (exactly what the simulator gives; uneven
  micro-batches are simulated).  It assumes workers do not slow each other down.

This is the prediction the accuracy benchmark (``benchmarks/planner_accuracy.py``) compares with
measured iteration times.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field, replace

from afdserve.planner import perf_model as pm
from afdserve.planner.profile import AttentionCost, ExpertCost, Profile, RuntimeCosts
from afdserve.planner.simulator import SimConfig, simulate
from afdserve.planner.spec import ModelSpec

__all__ = [
    "LocalPrediction",
    "RuntimeSim",
    "predict_local",
    "predict_iteration_time",
    "simulate_runtime",
    "micro_batch_sizes",
    "pinned_round_robin",
    "tokens_per_expert_worker",
]


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
    method: str = "analytic"  # "analytic" (Eq. 5 pipeline) or "runtime" (simulated runtime)
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


def micro_batch_sizes(batch: int, m: int) -> tuple[int, ...]:
    """How the runtime splits ``batch`` decode tokens into ``m`` micro-batches (``runtime.microbatch``:
    boundaries ``round(batch * i / m)``; never more micro-batches than tokens)."""
    mm = max(1, min(m, batch))
    bounds = [round(batch * i / mm) for i in range(mm + 1)]
    return tuple(bounds[i + 1] - bounds[i] for i in range(mm))


# --------------------------------------------------------------------------------------------
# discrete-event simulation of the runtime (processes sharing cores)
# --------------------------------------------------------------------------------------------
@dataclass
class _Msg:
    src: int  # sending process
    layer: int
    mb: int
    pairs: float  # token-expert pairs for the receiving expert worker
    tokens: float


@dataclass
class _Proc:
    name: str
    gen: Generator
    state: str = "ready"  # ready | cpu | wait | wake | sleep | done
    remaining: float = 0.0
    busy: float = 0.0
    wait_chans: tuple = ()
    wait_any: bool = False
    wait_start: float = 0.0
    wake_at: float = 0.0
    after_cpu: tuple | None = None  # a message to deliver when the current CPU burst (a send) ends
    step_ends: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class RuntimeSim:
    """Inputs of :func:`simulate_runtime` (seconds; see :mod:`afdserve.planner.local`)."""

    n_a: int
    n_e: int
    num_layers: int
    micro_batches: tuple[int, ...]  # tokens of each micro-batch of one attention worker
    ta: tuple[float, ...]  # attention worker CPU per micro-batch and layer (combine + attention + dispatch)
    te_per_pair: float  # k3
    te_fixed: float  # k4 of one expert worker
    pairs: tuple[float, ...]  # pairs one expert worker gets from one attention worker, per micro-batch
    tokens: tuple[float, ...]  # tokens in that message, per micro-batch
    fwd_bytes: tuple[float, ...]  # bytes of that message, per micro-batch
    back_bytes: tuple[float, ...]  # bytes of the reply, per micro-batch
    step_overhead: float
    costs: RuntimeCosts
    steps: int = 6
    # core of each process (attention workers first, then expert workers), when pinned; None: the
    # processes share costs.cores cores as the OS balances them (processor sharing)
    affinity: tuple[int, ...] | None = None
    # attention worker i starts i * stagger late (None: one attention burst, ta[0]); the expert
    # workers then merge two workers' tokens only when they happen to arrive together
    stagger: float | None = None


@dataclass(frozen=True)
class RuntimeSimResult:
    step_s: float  # steady-state decode step of the slowest attention worker
    busy: tuple[float, ...]  # busy fraction of each process over the simulated window
    makespan: float


def _rates(running: list[_Proc], procs: list[_Proc], affinity: tuple[int, ...] | None, costs: RuntimeCosts,
           n_a: int) -> dict[int, float]:
    """Processor sharing: the runnable processes of a core (pinned) or of the machine share it;
    while more than one core computes, each process runs ``corun_*`` times slower."""
    if not running:
        return {}
    cores = costs.cores
    index = {id(p): i for i, p in enumerate(procs)}
    if affinity is None:
        share = 1.0 if cores <= 0 else min(1.0, cores / len(running))
        rates = {id(p): share for p in running}
        busy_cores = len(running) if cores <= 0 else min(cores, len(running))
    else:
        per_core: dict[int, int] = {}
        for p in running:
            per_core[affinity[index[id(p)]]] = per_core.get(affinity[index[id(p)]], 0) + 1
        rates = {id(p): 1.0 / per_core[affinity[index[id(p)]]] for p in running}
        busy_cores = len(per_core)
    if busy_cores > 1:
        for p in running:
            rates[id(p)] /= costs.corun_attention if index[id(p)] < n_a else costs.corun_expert
    return rates


def pinned_round_robin(n_a: int, n_e: int, cores: int) -> tuple[int, ...]:
    """Cores of the worker processes pinned round-robin (attention workers first, then experts)."""
    return tuple(i % max(cores, 1) for i in range(n_a + n_e))


def simulate_runtime(cfg: RuntimeSim) -> RuntimeSimResult:
    """Simulates ``cfg.steps`` decode steps of every worker process and returns the steady-state step
    time (mean over the steps after the first two, slowest attention worker)."""
    n_a, n_e, L = cfg.n_a, cfg.n_e, cfg.num_layers
    c = cfg.costs
    procs: list[_Proc] = []
    chans: dict[tuple[int, int], deque[_Msg]] = {}

    def chan(src: int, dst: int) -> deque[_Msg]:
        return chans.setdefault((src, dst), deque())

    def attention(i: int) -> Generator:
        me = i
        experts = [n_a + j for j in range(n_e)]
        extra = (n_e - 1) * c.dispatch_per_worker_s
        if i > 0:  # workers never start in lockstep (requests arrive one after the other)
            yield ("sleep", i * (cfg.ta[0] if cfg.stagger is None else cfg.stagger), None)
        for _step in range(cfg.steps):
            for layer in range(L + 1):
                for k, b_k in enumerate(cfg.micro_batches):
                    if layer > 0:  # combine: one reply per expert worker, in order
                        for e in experts:
                            yield ("recv", ((e, me),), False)
                            yield ("cpu", c.take_s, None)
                    if layer == L:  # this micro-batch's LM head, while the experts finish the others
                        yield ("cpu", c.lm_head_time(b_k), None)
                        continue
                    yield ("cpu", cfg.ta[k] + extra, None)
                    for e in experts:
                        msg = _Msg(me, layer, k, cfg.pairs[k], cfg.tokens[k])
                        yield ("send", (me, e), msg, cfg.fwd_bytes[k])
            yield ("cpu", cfg.step_overhead, None)
            yield ("step", None, None)

    def expert(j: int) -> Generator:
        me = n_a + j
        ins = tuple((a, me) for a in range(n_a))
        while True:
            msgs = yield ("recv", ins, True)
            yield ("cpu", c.take_s * len(msgs), None)
            groups: dict[int, list[_Msg]] = {}
            for mm in msgs:
                groups.setdefault(mm.layer, []).append(mm)
            for group in groups.values():
                yield ("cpu", cfg.te_fixed + cfg.te_per_pair * sum(mm.pairs for mm in group), None)
                for mm in group:
                    reply = _Msg(me, mm.layer, mm.mb, mm.pairs, mm.tokens)
                    yield ("send", (me, mm.src), reply, cfg.back_bytes[mm.mb])

    for i in range(n_a):
        procs.append(_Proc(f"attention{i}", attention(i)))
    for j in range(n_e):
        procs.append(_Proc(f"expert{j}", expert(j)))

    now = 0.0

    def available(p: _Proc) -> list[_Msg] | None:
        if p.wait_any:
            got = [chan(*k).popleft() for k in p.wait_chans if chan(*k)]
            return got or None
        q = chan(*p.wait_chans[0])
        return [q.popleft()] if q else None

    def asleep(p: _Proc) -> bool:
        return p.state == "wait" and now - p.wait_start > c.spin_s

    def advance(p: _Proc, value: object) -> None:
        while True:
            try:
                cmd = p.gen.send(value)
            except StopIteration:
                p.state = "done"
                return
            value = None
            kind = cmd[0]
            if kind == "cpu":
                if cmd[1] > 0:
                    p.state, p.remaining, p.after_cpu = "cpu", cmd[1], None
                    return
            elif kind == "send":
                key, msg, nbytes = cmd[1], cmd[2], cmd[3]
                cost = c.send_time(nbytes, receiver_asleep=asleep(procs[key[1]]))
                p.state, p.remaining, p.after_cpu = "cpu", cost, (key, msg)
                if cost <= 0:
                    deliver(key, msg)
                    continue
                return
            elif kind == "recv":
                p.wait_chans, p.wait_any = cmd[1], cmd[2]
                got = available(p)
                if got is not None:
                    value = got
                    continue
                p.state, p.wait_start = "wait", now
                return
            elif kind == "step":
                p.step_ends.append(now)
            elif kind == "sleep":
                p.state, p.wake_at = "sleep", now + cmd[1]
                return

    def deliver(key: tuple[int, int], msg: _Msg) -> None:
        chan(*key).append(msg)
        r = procs[key[1]]
        if r.state == "wait" and key in r.wait_chans:
            r.state = "wake"
            r.wake_at = now + (c.wake_s if now - r.wait_start > c.spin_s else 0.0)

    for p in procs:
        advance(p, None)
    attn = procs[:n_a]
    guard = 0
    while any(p.state != "done" for p in attn):
        guard += 1
        if guard > 10_000_000:  # pragma: no cover - a modelling bug, not an input error
            raise RuntimeError("runtime simulation did not finish")
        running = [p for p in procs if p.state == "cpu"]
        waking = [p for p in procs if p.state in ("wake", "sleep")]
        rates = _rates(running, procs, cfg.affinity, c, n_a)
        t_cpu = min((p.remaining / rates[id(p)] for p in running), default=math.inf)
        t_wake = min((p.wake_at for p in waking), default=math.inf) - now
        dt = max(0.0, min(t_cpu, t_wake))
        if math.isinf(dt):
            raise RuntimeError("runtime simulation deadlocked")  # pragma: no cover
        now += dt
        for p in running:
            p.remaining -= dt * rates[id(p)]
            p.busy += dt * rates[id(p)]
        for p in running:
            if p.remaining <= 1e-15:
                p.remaining = 0.0
                if p.after_cpu is not None:
                    key, msg = p.after_cpu
                    p.after_cpu = None
                    deliver(key, msg)
                p.state = "ready"
        for p in procs:
            if p.state == "sleep" and p.wake_at <= now + 1e-15:
                p.state = "ready"
                advance(p, None)
            if p.state == "wake" and p.wake_at <= now + 1e-15:
                got = available(p)
                if got is None:  # pragma: no cover - only its own deliveries wake a process
                    p.state = "wait"
                    continue
                p.state = "ready"
                advance(p, got)
        for p in running:
            if p.state == "ready":
                advance(p, None)
    first = min(2, cfg.steps - 1)
    per = [(p.step_ends[-1] - p.step_ends[first - 1]) / (len(p.step_ends) - first) if first > 0
           else p.step_ends[-1] / len(p.step_ends) for p in attn]
    return RuntimeSimResult(step_s=max(per), busy=tuple(p.busy / now for p in procs), makespan=now)


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

    ``pinned`` (runtime method): the worker processes are pinned to the profile's cores round-robin
    (attention workers first; :func:`pinned_round_robin`) instead of being balanced by the OS."""
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
    sizes = micro_batch_sizes(b, m) if method == "runtime" else _even_sizes(b, m)
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
        sim = simulate_runtime(RuntimeSim(
            n_a=n_a, n_e=n_e, num_layers=spec.num_layers, micro_batches=sizes, ta=tuple(ta),
            te_per_pair=exp.k3, te_fixed=exp.k4, pairs=tuple(pairs), tokens=tuple(toks), fwd_bytes=tuple(fwd),
            back_bytes=tuple(back), step_overhead=step, costs=rt,
            affinity=pinned_round_robin(n_a, n_e, rt.cores) if pinned else None))
        te = [exp.time(p * n_a) for p in pairs]
        return LocalPrediction(
            iteration_s=sim.step_s,
            pipeline_s=sim.step_s - step - lm_head,
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


def _even_sizes(b: int, m: int) -> tuple[int, ...]:
    mm = min(m, b)
    return tuple(b // mm + (1 if i < b % mm else 0) for i in range(mm))


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
