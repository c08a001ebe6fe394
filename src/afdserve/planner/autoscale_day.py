"""A simulated diurnal day: the autoscaling policy (``afdserve.planner.autoscale``) against the best
fixed deployment, on the planner's capacity model.

The deployment is the planner's AFD model of one preset on one GPU (``PlanEvaluator``: Eq. 5's
iteration time with ``Ta = k1*b_a + k2``, ``Te = k3*b_e + k4`` and the A2E/E2A transfers; one
evaluator per expert-pool size, ``n_e = E / experts_per_node``; the memory bound of Eq. 8 caps
``b_a``). At a demand of ``D`` decode tokens per second, ``n_a`` attention and ``n_e`` expert workers
run the smallest ``b_a`` whose throughput ``b_a*m*n_a / T(b_a)`` reaches ``D``; their TPOT is
``T(b_a)``. Beyond the memory bound the excess queues (a fluid backlog), and TTFT is the time to
drain it plus one iteration.

The trace: decode demand ``base * (1 + (r-1) * (1 - cos(2 pi (h - 4) / 24)) / 2)`` (trough at 04:00,
peak/trough ``r``), times ``1 + noise * N(0, 1)`` per tick (seeded); the peak is ``peak_fraction``
of the largest deployment's capacity at the SLO. Each tick (``tick_s``) the policy gets the
signals the live server would send (TPOT, TTFT, waiting requests, KV usage, throughput, busy
fractions) and the model (``PlannerPoolModel``). A grow takes effect ``resize_lag_s`` later (the
new workers load their weights; they are paid from the decision on); a shrink at once. A tick meets
the SLO when its TPOT and TTFT are within the SLO; attainment is the share of the day's tokens
that arrive in such ticks.

The answer: the autoscaled day's worker-hours against the cheapest fixed ``(n_a, n_e)`` (within the
same bounds) whose attainment is at least the autoscaled day's.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field, replace
from typing import Any

from afdserve.errors import ConfigError
from afdserve.planner.autoscale import AutoscaleConfig, AutoscalePolicy, Decision, Signals
from afdserve.planner.catalog import load_catalog
from afdserve.planner.cost_source import CostSource
from afdserve.planner.evaluator import PlanEvaluator, evaluators
from afdserve.planner.presets import preset
from afdserve.planner.search_config import SearchConfig


@dataclass(frozen=True)
class DayConfig:
    model: str = "mixtral-8x22b"
    gpu: str = "H800"
    tp_a: int = 2
    tp_e: int = 2
    micro_batches: int = 2
    slo_tpot_s: float = 0.100
    slo_ttft_s: float = 5.0
    max_attention: int = 16  # the attention pool's bounds are 1..max_attention
    hours: float = 24.0
    tick_s: float = 60.0
    peak_trough: float = 6.0
    noise: float = 0.05
    peak_fraction: float = 0.8  # the peak demand / the largest deployment's capacity at the SLO
    output_tokens: int = 256  # per request (waiting requests = backlog tokens / this)
    resize_lag_s: float = 120.0
    window_s: float = 120.0
    cooldown_s: float = 300.0
    target_attainment: float = 0.99
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hours <= 0 or self.tick_s <= 0 or self.tick_s > self.hours * 3600:
            raise ConfigError("invalid day: need hours > 0 and 0 < tick_s <= the day")
        if self.peak_trough < 1 or self.noise < 0 or not 0 < self.peak_fraction <= 1:
            raise ConfigError("invalid trace: need peak_trough >= 1, noise >= 0, 0 < peak_fraction <= 1")
        if self.max_attention < 1 or self.output_tokens < 1 or not 0 < self.target_attainment <= 1:
            raise ConfigError("invalid max_attention / output_tokens / target_attainment")


@dataclass(frozen=True)
class Point:
    """A deployment serving a demand: its TPOT, the rate it serves, its KV use and busy fractions."""

    tpot_s: float
    served_tok_s: float
    kv_usage: float
    attention_busy: float
    expert_busy: float


class PlannerPoolModel:
    """The planner's capacity model of ``n_a`` x ``n_e`` workers (the ``PoolModel`` the policy asks)."""

    def __init__(self, cfg: DayConfig):
        spec = preset(cfg.model)
        if spec is None:
            raise ConfigError(f"unknown model preset {cfg.model!r}")
        gpu = load_catalog().get(cfg.gpu)
        scfg = SearchConfig(slo_s=cfg.slo_tpot_s, tp_choices=tuple(sorted({cfg.tp_a, cfg.tp_e})))
        self.m, self.layers, self.slo_s = cfg.micro_batches, spec.num_layers, cfg.slo_tpot_s
        self.evals: dict[int, PlanEvaluator] = {
            ev.n_e: ev for ev in evaluators(spec, gpu, gpu, scfg, CostSource(spec, scfg))
            if (ev.tp_a, ev.tp_e) == (cfg.tp_a, cfg.tp_e)}
        if not self.evals:
            raise ConfigError(f"{cfg.model} does not fit {cfg.gpu} at tp_a={cfg.tp_a}, tp_e={cfg.tp_e}")
        self.expert_sizes = tuple(sorted(self.evals))
        self._tables: dict[tuple[int, int], tuple[list[float], list[float]]] = {}

    def _table(self, n_a: int, n_e: int) -> tuple[list[float], list[float]]:
        """Per b_a = 1..memory cap: the best throughput at a batch <= b_a, and T(b_a)."""
        key = (n_a, n_e)
        if key not in self._tables:
            ev = self.evals[n_e]
            rates, times, best = [], [], 0.0
            for b_a in range(1, ev.memory_cap(self.m) + 1):
                t = ev.t_total(b_a, n_a, self.m)
                best = max(best, b_a * self.m * n_a / t)
                rates.append(best)
                times.append(t)
            self._tables[key] = rates, times
        return self._tables[key]

    def capacity(self, n_a: int, n_e: int) -> float:
        """Decode tokens per second at the largest b_a whose TPOT is within the SLO."""
        rates, times = self._table(n_a, n_e)
        i = bisect.bisect_right(times, self.slo_s)
        return rates[i - 1] if i else 0.0

    def point(self, n_a: int, n_e: int, demand_tok_s: float) -> Point:
        ev = self.evals[n_e]
        rates, times = self._table(n_a, n_e)
        i = min(bisect.bisect_left(rates, demand_tok_s), len(rates) - 1)
        b_a = i + 1
        ta, te, _, _ = ev.times(b_a, n_a)
        work = self.m * self.layers
        return Point(times[i], min(demand_tok_s, rates[i]), b_a / len(rates), min(1.0, ta * work / times[i]),
                     min(1.0, te * work / times[i]))

    def tpot(self, n_a: int, n_e: int, demand_tok_s: float) -> float:
        rates, times = self._table(n_a, n_e)
        i = bisect.bisect_left(rates, demand_tok_s)
        return times[i] if i < len(rates) else math.inf


def demand_trace(cfg: DayConfig, peak_tok_s: float) -> list[float]:
    rng = random.Random(cfg.seed)
    base = peak_tok_s / cfg.peak_trough
    out = []
    for k in range(int(cfg.hours * 3600 / cfg.tick_s)):
        h = k * cfg.tick_s / 3600
        shape = 1 + (cfg.peak_trough - 1) * (1 - math.cos(2 * math.pi * (h - 4) / 24)) / 2
        out.append(max(0.0, base * shape * (1 + cfg.noise * rng.gauss(0, 1))))
    return out


@dataclass
class DayRun:
    attention: int  # the sizes at the start (fixed: throughout)
    experts: int
    worker_hours: float = 0.0
    gpu_hours: float = 0.0
    met_tokens: float = 0.0
    tokens: float = 0.0
    resizes: int = 0
    timeline: list[dict[str, Any]] = field(default_factory=list)  # autoscaled runs: every resize

    @property
    def attainment(self) -> float:
        return self.met_tokens / self.tokens if self.tokens else 1.0

    def summary(self) -> dict[str, Any]:
        return {"attention": self.attention, "experts": self.experts, "worker_hours": round(self.worker_hours, 2),
                "gpu_hours": round(self.gpu_hours, 2), "slo_attainment": round(self.attainment, 5),
                "resizes": self.resizes}


def simulate_day(cfg: DayConfig, model: PlannerPoolModel, trace: list[float], sizes: tuple[int, int],
                 policy: AutoscalePolicy | None = None) -> DayRun:
    """One day at fixed ``sizes`` or, with ``policy``, starting at ``sizes`` and resized by it."""
    run = DayRun(*sizes)
    n_a, n_e = sizes
    pending: tuple[float, int, int] | None = None  # a grow: (when it takes effect, n_a, n_e)
    backlog, dt = 0.0, cfg.tick_s
    for k, demand in enumerate(trace):
        now = k * dt
        if pending is not None and now >= pending[0]:
            n_a, n_e, pending = pending[1], pending[2], None
        paid = (n_a, n_e) if pending is None else (max(n_a, pending[1]), max(n_e, pending[2]))
        run.worker_hours += sum(paid) * dt / 3600
        run.gpu_hours += (paid[0] * cfg.tp_a + paid[1] * cfg.tp_e) * dt / 3600
        want = demand + backlog / dt
        p = model.point(n_a, n_e, want)
        backlog = max(0.0, (want - p.served_tok_s) * dt)
        ttft = backlog / max(p.served_tok_s, 1e-9) + p.tpot_s
        run.tokens += demand * dt
        if p.tpot_s <= cfg.slo_tpot_s and ttft <= cfg.slo_ttft_s:
            run.met_tokens += demand * dt
        if policy is None or pending is not None:
            continue
        sig = Signals(waiting=int(backlog / cfg.output_tokens), kv_usage=p.kv_usage, tpot_s=p.tpot_s, ttft_s=ttft,
                      throughput_tok_s=want, attention_busy=p.attention_busy, expert_busy=p.expert_busy)
        d = policy.decide(sig, now)
        if d.action == "hold":
            continue
        policy.resized(d.attention, d.experts, now)
        run.resizes += 1
        run.timeline.append(_event(d, sig))
        if d.action == "up":
            pending = (now + cfg.resize_lag_s, d.attention, d.experts)
        else:
            n_a, n_e = d.attention, d.experts
    return run


def _event(d: Decision, s: Signals) -> dict[str, Any]:
    return {"hour": round(d.time / 3600, 3), "action": d.action, "pool": d.pool, "attention": d.attention,
            "experts": d.experts, "reason": d.reason, "demand_tok_s": round(s.throughput_tok_s),
            "tpot_ms": round((s.tpot_s or 0) * 1e3, 1), "kv_usage": round(s.kv_usage, 3)}


@dataclass
class DayReport:
    config: DayConfig
    peak_tok_s: float
    autoscaled: DayRun
    fixed: DayRun | None  # the cheapest fixed deployment at (at least) the autoscaled attainment
    fixed_candidates: list[DayRun]

    @property
    def saved(self) -> float:
        if self.fixed is None:
            return math.nan
        return 1 - self.autoscaled.worker_hours / self.fixed.worker_hours

    def to_json(self) -> dict[str, Any]:
        return {"config": vars(self.config), "peak_demand_tok_s": round(self.peak_tok_s),
                "autoscaled": self.autoscaled.summary(),
                "best_fixed": self.fixed.summary() if self.fixed else None,
                "worker_hours_saved": round(self.saved, 4),
                "gpu_hours_saved": round(1 - self.autoscaled.gpu_hours / self.fixed.gpu_hours, 4)
                if self.fixed else None,
                "meets_target": self.autoscaled.attainment >= self.config.target_attainment,
                "resizes": self.autoscaled.timeline}


def run_day(cfg: DayConfig = DayConfig()) -> DayReport:
    model = PlannerPoolModel(cfg)
    a_sizes, e_sizes = tuple(range(1, cfg.max_attention + 1)), model.expert_sizes
    peak = cfg.peak_fraction * model.capacity(a_sizes[-1], e_sizes[-1])
    if peak <= 0:
        raise ConfigError(f"even the largest deployment misses the {cfg.slo_tpot_s * 1e3:g} ms TPOT SLO")
    trace = demand_trace(cfg, peak)
    acfg = AutoscaleConfig(a_sizes, e_sizes, cfg.slo_tpot_s, cfg.slo_ttft_s, window_s=cfg.window_s,
                           cooldown_s=cfg.cooldown_s)
    fits = [(a, e) for a in a_sizes for e in e_sizes if model.tpot(a, e, trace[0]) <= 0.9 * cfg.slo_tpot_s]
    start = min(fits, key=lambda t: (sum(t), t)) if fits else (a_sizes[-1], e_sizes[-1])  # serves the first tick
    auto = simulate_day(cfg, model, trace, start, AutoscalePolicy(acfg, *start, model=model))
    fixed = [simulate_day(cfg, model, trace, (a, e)) for a in a_sizes for e in e_sizes]
    ok = [r for r in fixed if r.attainment >= auto.attainment]
    best = min(ok, key=lambda r: (r.worker_hours, r.gpu_hours)) if ok else None
    return DayReport(cfg, peak, auto, best, fixed)


def with_overrides(cfg: DayConfig, **kw: Any) -> DayConfig:
    return replace(cfg, **{k: v for k, v in kw.items() if v is not None})
