"""A discrete-event simulation of this repository's runtime: worker processes sharing CPU cores.

``n_a`` attention worker processes and ``n_e`` expert worker processes run the runtime's own control
flow.  An attention worker keeps ``m`` steps in flight, one per **lane** (``runtime/lanes.py``): a
lane's step is its micro-batch's ``begin`` (scheduling), then per layer attention (``ta``) and a
``dispatch`` (one ``send`` per expert worker), a wait for every expert worker's reply (``take_s``
each), and after the last layer its LM head (``costs.lm_head_*``) and ``finish`` (the rest of the
step overhead: sampling, outputs).  As ``Lanes.advance`` does, the worker first takes the replies
that came, resumes a lane whose replies are complete, else begins a step on an idle lane, else
finishes the oldest lane waiting to; a lane that finishes begins its next step, so the pipeline
never drains between steps.  Each expert worker loops ``gather`` (the next message of every
attention worker that has one), runs the experts once per layer present over the merged tokens
(``te_fixed + te_per_pair * pairs``) and sends each sender its partial sums.  Sends and takes cost
the measured CPU time, a receiver asleep in ``poll`` wakes up after ``wake_s``, when more workers are
runnable than ``costs.cores`` they share the cores equally (processor sharing), while two cores
compute at once each worker runs the measured ``corun_*`` factor slower, and a fused MoE or an LM
head that runs while other workers wait borrows their cores (the cpu backend's lent cores:
``costs.lend_*``, measured speed-ups on every core).

Processes are generators yielding what they do next (``cpu``, ``send``, ``recv``, ``poll``,
``sleep``, ``step``); CPU bursts end as processor sharing lets them, timed wake-ups come from an
:class:`~afdserve.planner.events.EventQueue`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field

from afdserve.planner.costs import RuntimeCosts, interp_extend
from afdserve.planner.events import EventQueue

__all__ = ["RuntimeSim", "RuntimeSimResult", "simulate_runtime", "pinned_round_robin"]


@dataclass
class _Msg:
    src: int  # sending process
    layer: int
    mb: int
    pairs: float  # token-expert pairs for the receiving expert worker
    tokens: float


@dataclass
class _Proc:
    index: int  # attention workers first, then expert workers
    gen: Generator
    state: str = "ready"  # ready | cpu | wait | wake | sleep | done (wake, sleep: a timer is queued)
    remaining: float = 0.0
    busy: float = 0.0
    wait_chans: tuple = ()
    wait_any: bool = False
    wait_start: float = 0.0
    after_cpu: tuple | None = None  # a message to deliver when the current CPU burst (a send) ends
    speedup: float = 1.0  # of the current CPU burst on every core, when other workers lend theirs
    step_ends: dict[int, list[float]] = field(default_factory=dict)  # lane -> when its steps ended


@dataclass(frozen=True)
class RuntimeSim:
    """Inputs of :func:`simulate_runtime` (seconds; see the module docstring)."""

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
    step_overhead: tuple[float, ...]  # attention worker CPU per lane step outside its layers, per micro-batch
    costs: RuntimeCosts
    steps: int = 6
    # core of each process (attention workers first, then expert workers), when pinned; None: the
    # processes share costs.cores cores as the OS balances them (processor sharing)
    affinity: tuple[int, ...] | None = None
    # attention worker i starts i * stagger late (None: one attention burst, ta[0]); the expert
    # workers then merge two workers' tokens only when they happen to arrive together
    stagger: float | None = None
    # the part of step_overhead before the lane's first layer (Engine.begin), per micro-batch; () none
    begin: tuple[float, ...] = ()
    # measured (pairs, seconds) of an expert worker's layer: interpolated instead of te_fixed + te_per_pair
    te_points: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class RuntimeSimResult:
    step_s: float  # steady-state decode step (a lane's step period) of the slowest attention worker
    busy: tuple[float, ...]  # busy fraction of each process over the simulated window
    makespan: float


def _rates(running: list[_Proc], affinity: tuple[int, ...] | None, costs: RuntimeCosts,
           n_a: int, lenders: int) -> dict[int, float]:
    """Processor sharing, by process index: the runnable processes of a core (pinned) or of the
    machine share it; while more than one core computes, each process runs ``corun_*`` times slower.
    Unpinned, the cores no runnable process takes are lent by the ``lenders`` waiting workers (one
    thread each) to the bursts that can borrow them (``speedup`` > 1, measured on every core)."""
    if not running:
        return {}
    cores = costs.cores
    if affinity is None:
        share = 1.0 if cores <= 0 else min(1.0, cores / len(running))
        rates = {p.index: share for p in running}
        busy_cores = len(running) if cores <= 0 else min(cores, len(running))
        borrowers = [p for p in running if p.speedup > 1.0]
        lent = min(lenders, cores - len(running)) if cores > 1 else 0
        if borrowers and lent > 0:
            for p in borrowers:  # a speed-up measured on all `cores`, scaled to the threads it gets
                extra = lent / len(borrowers) / (cores - 1)
                rates[p.index] *= 1.0 + (p.speedup - 1.0) * min(1.0, extra)
            busy_cores = min(cores, busy_cores + lent)
    else:
        per_core: dict[int, int] = {}
        for p in running:
            per_core[affinity[p.index]] = per_core.get(affinity[p.index], 0) + 1
        rates = {p.index: 1.0 / per_core[affinity[p.index]] for p in running}
        busy_cores = len(per_core)
    if busy_cores > 1 and len(running) > 1:
        for p in running:
            rates[p.index] /= costs.corun_attention if p.index < n_a else costs.corun_expert
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

    m = len(cfg.micro_batches)
    begin = cfg.begin or (0.0,) * m

    def attention(i: int) -> Generator:
        me = i
        experts = [n_a + j for j in range(n_e)]
        ins = tuple((e, me) for e in experts)
        extra = (n_e - 1) * c.dispatch_per_worker_s
        layer = [-1] * m  # per lane: the layer its step is at (-1: idle)
        got = [0] * m  # replies of that layer so far
        began = [0] * m  # when the lane's step began (the oldest finishes first)
        ready: deque[int] = deque()  # lanes whose replies came
        runnable: list[int] = []  # lanes past their LM head, to finish
        count = 0
        if i > 0:  # workers never start in lockstep (requests arrive one after the other)
            yield ("sleep", i * (cfg.ta[0] if cfg.stagger is None else cfg.stagger), None)

        def dispatch(k: int) -> Generator:
            yield ("cpu", cfg.ta[k] + extra, None)
            for e in experts:
                yield ("send", (me, e), _Msg(me, layer[k], k, cfg.pairs[k], cfg.tokens[k]), cfg.fwd_bytes[k])

        came: list[_Msg] = []
        while True:
            came += yield ("poll", ins, None)  # Lanes.advance: first the replies that came
            for msg in came:
                yield ("cpu", c.take_s, None)
                got[msg.mb] += 1
                if got[msg.mb] == n_e:
                    got[msg.mb] = 0
                    ready.append(msg.mb)
            came = []
            if ready:  # combine, then the next layer or the LM head
                k = ready.popleft()
                if layer[k] + 1 < L:
                    layer[k] += 1
                    yield from dispatch(k)
                else:
                    b_k = cfg.micro_batches[k]
                    yield ("cpu", c.lm_head_time(b_k), c.lend_lm_head_speedup(b_k))
                    runnable.append(k)
                continue
            idle = next((k for k in range(m) if layer[k] < 0), None)  # (a runnable lane is at layer L-1)
            if idle is not None:  # a new step on an idle lane
                began[idle], count = count, count + 1
                yield ("cpu", begin[idle], None)
                layer[idle] = 0
                yield from dispatch(idle)
                continue
            if runnable:  # the oldest step finishes: sampling, outputs
                k = min(runnable, key=lambda x: began[x])
                runnable.remove(k)
                yield ("cpu", max(0.0, cfg.step_overhead[k] - begin[k]), None)
                layer[k] = -1
                yield ("step", k, None)
                if all(len(procs[me].step_ends.get(x, ())) >= cfg.steps for x in range(m)):
                    return
                continue
            came = yield ("recv", ins, True)

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
                pairs = sum(mm.pairs for mm in group)
                te = interp_extend(cfg.te_points, pairs) if cfg.te_points else cfg.te_fixed + cfg.te_per_pair * pairs
                yield ("cpu", te, c.lend_expert_speedup(pairs))
                for mm in group:
                    reply = _Msg(me, mm.layer, mm.mb, mm.pairs, mm.tokens)
                    yield ("send", (me, mm.src), reply, cfg.back_bytes[mm.mb])

    for i in range(n_a):
        procs.append(_Proc(i, attention(i)))
    for j in range(n_e):
        procs.append(_Proc(n_a + j, expert(j)))

    now = 0.0
    timers: EventQueue[int] = EventQueue()  # index of a sleeping or waking process, when it runs again

    def wake_at(p: _Proc, t: float) -> None:
        timers.push(t, p.index, rank=p.index)

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
                    p.state, p.remaining, p.after_cpu, p.speedup = "cpu", cmd[1], None, cmd[2] or 1.0
                    return
            elif kind == "send":
                key, msg, nbytes = cmd[1], cmd[2], cmd[3]
                cost = c.send_time(nbytes, receiver_asleep=asleep(procs[key[1]]))
                p.state, p.remaining, p.after_cpu, p.speedup = "cpu", cost, (key, msg), 1.0
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
            elif kind == "poll":  # everything that came, without waiting
                value = [q.popleft() for k in cmd[1] for q in (chan(*k),) for _ in range(len(q))]
            elif kind == "step":
                p.step_ends.setdefault(cmd[1], []).append(now)
            elif kind == "sleep":
                p.state = "sleep"
                wake_at(p, now + cmd[1])
                return

    def deliver(key: tuple[int, int], msg: _Msg) -> None:
        chan(*key).append(msg)
        r = procs[key[1]]
        if r.state == "wait" and key in r.wait_chans:
            r.state = "wake"
            wake_at(r, now + (c.wake_s if now - r.wait_start > c.spin_s else 0.0))

    for p in procs:
        advance(p, None)
    attn = procs[:n_a]
    guard = 0
    while any(p.state != "done" for p in attn):
        guard += 1
        if guard > 10_000_000:  # pragma: no cover - a modelling bug, not an input error
            raise RuntimeError("runtime simulation did not finish")
        running = [p for p in procs if p.state == "cpu"]
        lenders = sum(1 for p in procs if p.state in ("wait", "wake"))
        rates = _rates(running, cfg.affinity, c, n_a, lenders)
        t_cpu = min((p.remaining / rates[p.index] for p in running), default=math.inf)
        dt = max(0.0, min(t_cpu, timers.next_time() - now))
        if math.isinf(dt):
            raise RuntimeError("runtime simulation deadlocked")  # pragma: no cover
        now += dt
        for p in running:
            p.remaining -= dt * rates[p.index]
            p.busy += dt * min(1.0, rates[p.index])
        for p in running:
            if p.remaining <= 1e-15:
                p.remaining = 0.0
                if p.after_cpu is not None:
                    key, msg = p.after_cpu
                    p.after_cpu = None
                    deliver(key, msg)
                p.state = "ready"
        while timers.next_time() <= now + 1e-15:
            p = procs[timers.pop()[1]]
            got = available(p) if p.state == "wake" else None
            if p.state == "wake" and got is None:  # pragma: no cover - only its own deliveries wake a process
                p.state = "wait"
                continue
            p.state = "ready"
            advance(p, got)
        for p in running:
            if p.state == "ready":
                advance(p, None)
    first = min(2, cfg.steps - 1)

    def period(ends: list[float]) -> float:
        ends = ends[:cfg.steps]
        return (ends[-1] - ends[first - 1]) / (len(ends) - first) if first > 0 else ends[-1] / len(ends)

    per = [sum(period(e) for e in p.step_ends.values()) / len(p.step_ends) for p in attn]
    return RuntimeSimResult(step_s=max(per), busy=tuple(p.busy / now for p in procs), makespan=now)
