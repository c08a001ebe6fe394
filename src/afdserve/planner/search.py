"""Deployment-plan search (MegaScale-Infer Algorithm 1), homogeneous or heterogeneous.

For every attention-GPU x expert-GPU pair, every ``tp_e`` and ``tp_a`` whose weights fit (line 4),
and every ``experts_per_node`` (1 in the paper; more lets fine-grained MoEs share a node), we take
``n_a`` from the balance rule (constraint 1) and its neighbours, try ``m = 1 .. N_m``
micro-batches, and binary-search the largest per-attention-node micro-batch ``b_a`` whose
iteration time meets the SLO (Eq. 7) and whose KV cache fits (Eq. 8).  Plans are ranked by
throughput per cost (or per GPU / per watt).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from afdserve.errors import ConfigError
from afdserve.planner import perf_model as pm
from afdserve.planner import roofline
from afdserve.planner.catalog import GPUSpec
from afdserve.planner.profile import AttentionCost, ExpertCost, Profile, UtilCurve
from afdserve.planner.roofline import RooflineOptions
from afdserve.planner.spec import ModelSpec

__all__ = [
    "SearchConfig",
    "Plan",
    "SearchResult",
    "CostSource",
    "search",
    "evaluate",
    "sweep",
    "HeteroComparison",
    "compare_hetero",
    "DEFAULT_SEQ_LEN",
]

Objective = Literal["auto", "cost", "gpu", "watt"]

#: Average decoding sequence length: the paper's workload has median input 571 and output 159
#: tokens (§7.1); halfway through decoding a sequence holds 571 + 159/2 ~ 650 tokens.
DEFAULT_SEQ_LEN = 650


@dataclass(frozen=True)
class SearchConfig:
    slo_s: float = 0.150  # time-between-tokens SLO (paper §7.1: 150 ms)
    seq_len: float = DEFAULT_SEQ_LEN
    tp_choices: tuple[int, ...] = (1, 2, 4, 8)
    max_micro_batches: int = 4  # N_m
    min_micro_batches: int = 1
    na_radius: int = 2  # n_a candidates: balance rule +- radius
    max_n_a: int = 1024
    experts_per_node: tuple[int, ...] | None = None  # None: powers of two dividing E
    require_overlap: bool = False  # keep only plans meeting constraints (2) and (3)
    max_b_a: int = 1 << 16
    roofline: RooflineOptions = field(default_factory=RooflineOptions)
    link_latency_s: float = 0.0  # per-message latency for the estimated Util curve
    allow_roofline_fallback: bool = False  # with a profile: estimate what it does not cover
    objective: Objective = "auto"

    def __post_init__(self) -> None:
        if self.slo_s <= 0 or self.seq_len <= 0:
            raise ConfigError("slo_s and seq_len must be positive")
        if not 1 <= self.min_micro_batches <= self.max_micro_batches:
            raise ConfigError("need 1 <= min_micro_batches <= max_micro_batches")
        if not self.tp_choices or any(t < 1 for t in self.tp_choices):
            raise ConfigError("tp_choices must be positive integers")


@dataclass(frozen=True)
class Plan:
    """One deployment plan and its predicted performance (times in seconds, memory in GB)."""

    attention_gpu: str
    expert_gpu: str
    tp_a: int
    tp_e: int
    n_a: int
    n_e: int
    experts_per_node: int
    micro_batches: int
    batch: int  # global batch B
    b_a: int  # tokens per micro-batch per attention node
    b_e: float  # token-expert pairs per micro-batch per expert node
    ta_s: float
    te_s: float
    tc_s: float
    tbt_s: float  # iteration time of the global batch = time between tokens
    iter_lower_s: float  # Eq. (4)
    iter_upper_s: float
    throughput_tok_s: float
    throughput_per_gpu: float
    throughput_per_cost: float | None
    throughput_per_watt: float
    num_gpus: int
    cost: float | None
    power_w: float
    attention_mem_per_gpu_gb: float
    expert_mem_per_gpu_gb: float
    balance_ratio: float
    comm_hidden: bool
    pipeline_full: bool
    min_micro_batches: int
    source: str  # "roofline-estimate" | "profile" | "profile+roofline"

    @property
    def heterogeneous(self) -> bool:
        return self.attention_gpu != self.expert_gpu

    def objective_value(self, objective: str) -> float:
        if objective == "cost":
            return self.throughput_per_cost if self.throughput_per_cost is not None else -math.inf
        if objective == "watt":
            return self.throughput_per_watt
        return self.throughput_per_gpu

    def to_json(self) -> dict[str, Any]:
        """The CLI's JSON record: the documented keys first, then the details."""
        d = asdict(self)
        head = {
            "attention_gpu": self.attention_gpu,
            "expert_gpu": self.expert_gpu,
            "tp_a": self.tp_a,
            "tp_e": self.tp_e,
            "n_a": self.n_a,
            "n_e": self.n_e,
            "micro_batches": self.micro_batches,
            "batch": self.batch,
            "tbt_ms": self.tbt_s * 1e3,
            "throughput_tok_s": self.throughput_tok_s,
            "throughput_per_gpu": self.throughput_per_gpu,
            "throughput_per_cost": self.throughput_per_cost,
            "throughput_per_watt": self.throughput_per_watt,
        }
        extra = {k: v for k, v in d.items() if k not in head and k != "tbt_s"}
        for k in ("ta_s", "te_s", "tc_s", "iter_lower_s", "iter_upper_s"):
            extra[k.replace("_s", "_ms")] = extra.pop(k) * 1e3
        return {**head, **extra}


class CostSource:
    """Where k1..k4 and Util come from: a profile, the roofline, or both (see SearchConfig)."""

    def __init__(self, spec: ModelSpec, config: SearchConfig, profile: Profile | None = None) -> None:
        self.spec = spec
        self.config = config
        self.profile = profile
        self.used: set[str] = set()

    @property
    def fallback(self) -> bool:
        return self.profile is None or self.config.allow_roofline_fallback

    def attention(self, gpu: GPUSpec, tp: int) -> AttentionCost | None:
        if self.profile is not None:
            c = self.profile.attention_cost(gpu.name, tp)
            if c is not None:
                self.used.add("profile")
                return c
        if not self.fallback:
            return None
        self.used.add("roofline-estimate")
        return roofline.attention_cost(self.spec, gpu, tp, self.config.roofline)

    def expert(self, gpu: GPUSpec, tp: int, experts_per_node: int) -> ExpertCost | None:
        if self.profile is not None:
            c = self.profile.expert_cost(gpu.name, tp, experts_per_node)
            if c is not None:
                self.used.add("profile")
                return c
        if not self.fallback:
            return None
        self.used.add("roofline-estimate")
        return roofline.expert_cost(self.spec, gpu, tp, experts_per_node, self.config.roofline)

    def util(self, gpu: GPUSpec) -> UtilCurve:
        if self.profile is not None and self.profile.network is not None:
            return self.profile.network.util_curve()
        lat = self.config.link_latency_s
        return UtilCurve(peak=1.0, half_bytes=lat * gpu.net_Bps)

    def label(self, att: AttentionCost, exp: ExpertCost) -> str:
        from_profile = [
            self.profile is not None and any(c is att for c in self.profile.attention),
            self.profile is not None and any(c is exp for c in self.profile.expert),
        ]
        if all(from_profile):
            return "profile"
        return "profile+roofline" if any(from_profile) else "roofline-estimate"


def _experts_per_node_choices(spec: ModelSpec, config: SearchConfig) -> list[int]:
    if config.experts_per_node is not None:
        bad = [e for e in config.experts_per_node if e < 1 or spec.num_experts % e]
        if bad:
            raise ConfigError(f"experts_per_node {bad} must divide the {spec.num_experts} experts")
        return sorted(set(config.experts_per_node))
    out, e = [], 1
    while e <= spec.num_experts:
        if spec.num_experts % e == 0:
            out.append(e)
        e *= 2
    return out


def _na_candidates(n_star: float, radius: int, max_n_a: int) -> list[int]:
    if not math.isfinite(n_star):
        n_star = float(max_n_a)
    lo = max(1, math.floor(n_star) - radius)
    hi = min(max_n_a, max(1, math.ceil(n_star)) + radius)
    return list(range(lo, max(lo, hi) + 1))


class _Evaluator:
    """Evaluates plans for one (GPU pair, tp_a, tp_e, experts_per_node)."""

    def __init__(
        self,
        spec: ModelSpec,
        gpu_a: GPUSpec,
        gpu_e: GPUSpec,
        tp_a: int,
        tp_e: int,
        experts_per_node: int,
        att: AttentionCost,
        exp: ExpertCost,
        util: tuple[UtilCurve, UtilCurve],
        config: SearchConfig,
        source: str,
    ) -> None:
        self.spec, self.gpu_a, self.gpu_e = spec, gpu_a, gpu_e
        self.tp_a, self.tp_e, self.epn = tp_a, tp_e, experts_per_node
        self.n_e = spec.num_experts // experts_per_node
        self.att, self.exp, self.util, self.config, self.source = att, exp, util, config, source
        self.k1 = att.k1(config.seq_len)
        self._mem_cap: dict[int, int] = {}

    def memory_cap(self, m: int) -> int:
        """Largest ``b_a`` that Eq. (8) allows (capped by ``max_b_a``)."""
        cap = self._mem_cap.get(m)
        if cap is None:
            cfg = self.config
            cap = min(cfg.max_b_a, pm.max_b_a_for_memory(self.spec, m, cfg.seq_len, self.tp_a, self.gpu_a.memory_bytes))
            self._mem_cap[m] = cap
        return cap

    def n_a_candidates(self, m: int) -> list[int]:
        """``n_a`` from the balance rule and its neighbours.

        Two balance points: the paper's ``k1*n_e/(k3*K)``, which ignores ``k2``/``k4``, and the
        operating-point balance, which makes ``Ta = Te`` at the per-layer time the SLO allows
        (``Tf ~ SLO/(m*L)``) with ``b_a`` capped by Eq. (8).  They coincide when the constant
        terms are small; when expert weights dominate (``k4`` large) only the second is close.
        """
        s, cfg = self.spec, self.config
        k3 = self.exp.k3
        stars = [pm.balance_n_a(self.k1, k3, self.n_e, s.top_k) if k3 > 0 else math.inf]
        tf = cfg.slo_s / (m * s.num_layers)
        b_a = (tf - self.att.k2) / self.k1 if self.k1 > 0 else math.inf
        b_a = min(b_a, self.memory_cap(m))
        b_e = (tf - self.exp.k4) / k3 if k3 > 0 else math.inf
        if b_a >= 1 and b_e > 0:
            stars.append(b_e * self.n_e / (b_a * s.top_k))
        out: set[int] = set()
        for n_star in stars:
            out.update(_na_candidates(n_star, cfg.na_radius, cfg.max_n_a))
        return sorted(out)

    def times(self, b_a: float, n_a: int) -> tuple[float, float, float, float]:
        s = self.spec
        ta = self.k1 * b_a + self.att.k2
        b_e = pm.expert_micro_batch(b_a, n_a, s.top_k, self.n_e)
        te = self.exp.k3 * b_e + self.exp.k4
        tc = pm.comm_time(
            pm.a2e_bytes_per_gpu(b_a, s.hidden_size, s.top_k, self.tp_a, s.act_bytes),
            self.n_e * self.tp_e,
            self.gpu_a.net_Bps,
            pm.expert_recv_bytes_per_gpu(b_e, s.hidden_size, self.tp_e, s.act_bytes),
            n_a * self.tp_a,
            self.gpu_e.net_Bps,
            self.util[0],
            self.util[1],
        )
        return ta, te, tc, b_e

    def t_total(self, b_a: float, n_a: int, m: int) -> float:
        ta, te, tc, _ = self.times(b_a, n_a)
        return pm.iteration_time(ta, te, tc, m, self.spec.num_layers)

    def max_b_a(self, n_a: int, m: int, *, bisect: bool = False) -> int:
        """Largest ``b_a`` meeting the SLO (Eq. 7) and memory (Eq. 8); 0 if none.

        ``T_total`` grows monotonically with ``b_a``, so a binary search finds it (Algorithm 1's
        SIMULATE).  When the Util curves are parametric, every time is affine in ``b_a`` and
        ``T_total`` is the maximum of 12 affine functions (see :meth:`_affine_limit`); the bound
        is then computed directly (same answer, ~15x fewer evaluations).
        """
        cfg = self.config
        hi = self.memory_cap(m)
        if hi < 1 or self.t_total(1, n_a, m) > cfg.slo_s:
            return 0
        if not bisect and not self.util[0].points and not self.util[1].points:
            b = min(hi, self._affine_limit(n_a, m))
            while b > 1 and self.t_total(b, n_a, m) > cfg.slo_s:  # guard against rounding
                b -= 1
            while b < hi and self.t_total(b + 1, n_a, m) <= cfg.slo_s:
                b += 1
            return max(b, 1)
        if self.t_total(hi, n_a, m) <= cfg.slo_s:
            return hi
        lo = 1  # invariant: t(lo) <= slo < t(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.t_total(mid, n_a, m) <= cfg.slo_s:
                lo = mid
            else:
                hi = mid
        return lo

    def _affine_limit(self, n_a: int, m: int) -> int:
        """``floor`` of the largest real ``b_a`` with ``T_total(b_a) <= SLO`` for parametric Util.

        With ``A = Ta``, ``E = Te``, ``S``/``R`` = send/receive side of Eq. (6), all affine in
        ``b_a``: ``T = C + (L-1)*max(m*Tf, C) + (m-1)*Tf`` with ``C = A + E + 2*max(S, R)`` and
        ``Tf = max(A, E)`` equals the maximum over the choices x in {S, R}, y, z in {A, E} of
        ``C_x + (L-1)*m*y + (m-1)*z`` and ``L*C_x + (m-1)*z``.
        """
        s, L = self.spec, self.spec.num_layers
        ua, ue = self.util
        h_act = s.hidden_size * s.act_bytes
        pairs_per_tok = n_a * s.top_k / self.n_e
        wa = self.gpu_a.net_Bps * ua.peak
        we = self.gpu_e.net_Bps * ue.peak
        a = (self.k1, self.att.k2)
        e = (self.exp.k3 * pairs_per_tok, self.exp.k4)
        snd = (h_act * s.top_k / (self.tp_a * wa), self.n_e * self.tp_e * ua.half_bytes / wa)
        rcv = (pairs_per_tok * h_act / (self.tp_e * we), n_a * self.tp_a * ue.half_bytes / we)

        slo = self.config.slo_s
        limit = math.inf
        for x in (snd, rcv):
            c = (a[0] + e[0] + 2 * x[0], a[1] + e[1] + 2 * x[1])
            for z in (a, e):
                tail = ((m - 1) * z[0], (m - 1) * z[1])
                comps = [(L * c[0] + tail[0], L * c[1] + tail[1])]
                for y in (a, e):
                    w = (L - 1) * m
                    comps.append((c[0] + w * y[0] + tail[0], c[1] + w * y[1] + tail[1]))
                for slope, icpt in comps:
                    if slope > 0:
                        limit = min(limit, (slo - icpt) / slope)
                    elif icpt > slo:
                        return 0
        return int(min(limit, float(self.config.max_b_a)))

    def plan(self, n_a: int, m: int) -> Plan | None:
        b_a = self.max_b_a(n_a, m)
        if b_a < 1:
            return None
        return self.plan_at(n_a, m, b_a)

    def plan_at(self, n_a: int, m: int, b_a: int) -> Plan | None:
        s, cfg = self.spec, self.config
        ta, te, tc, b_e = self.times(b_a, n_a)
        t = pm.iteration_time(ta, te, tc, m, s.num_layers)
        chk = pm.check_pipeline(ta, te, tc, m)
        if cfg.require_overlap and not (chk.comm_hidden and chk.pipeline_full):
            return None
        lo, hi = pm.iteration_bounds(ta, te, tc, m, s.num_layers)
        batch = int(pm.global_batch(b_a, m, n_a))
        eff = pm.efficiency(
            batch,
            t,
            self.tp_a,
            n_a,
            self.tp_e,
            self.n_e,
            self.gpu_a.price,
            self.gpu_e.price,
            self.gpu_a.power_w,
            self.gpu_e.power_w,
        )
        att_mem = pm.attention_memory_bytes(s, m, b_a, cfg.seq_len, self.tp_a) / self.tp_a
        exp_mem = s.expert_node_param_bytes(self.epn) / self.tp_e
        return Plan(
            attention_gpu=self.gpu_a.name,
            expert_gpu=self.gpu_e.name,
            tp_a=self.tp_a,
            tp_e=self.tp_e,
            n_a=n_a,
            n_e=self.n_e,
            experts_per_node=self.epn,
            micro_batches=m,
            batch=batch,
            b_a=b_a,
            b_e=b_e,
            ta_s=ta,
            te_s=te,
            tc_s=tc,
            tbt_s=t,
            iter_lower_s=lo,
            iter_upper_s=hi,
            throughput_tok_s=eff.throughput_tok_s,
            throughput_per_gpu=eff.throughput_per_gpu,
            throughput_per_cost=eff.throughput_per_cost,
            throughput_per_watt=eff.throughput_per_watt,
            num_gpus=eff.num_gpus,
            cost=eff.cost,
            power_w=eff.power_w,
            attention_mem_per_gpu_gb=att_mem / 1e9,
            expert_mem_per_gpu_gb=exp_mem / 1e9,
            balance_ratio=chk.balance_ratio,
            comm_hidden=chk.comm_hidden,
            pipeline_full=chk.pipeline_full,
            min_micro_batches=chk.min_micro_batches,
            source=self.source,
        )


def _evaluators(
    spec: ModelSpec, gpu_a: GPUSpec, gpu_e: GPUSpec, config: SearchConfig, costs: CostSource
) -> Iterable[_Evaluator]:
    util = (costs.util(gpu_a), costs.util(gpu_e))
    for tp_e in config.tp_choices:  # Algorithm 1, line 2
        for epn in _experts_per_node_choices(spec, config):
            if spec.expert_node_param_bytes(epn) >= tp_e * gpu_e.memory_bytes:  # line 4 (experts)
                continue
            exp = costs.expert(gpu_e, tp_e, epn)
            if exp is None:
                continue
            for tp_a in config.tp_choices:  # line 3
                if spec.attention_param_bytes >= tp_a * gpu_a.memory_bytes:  # line 4 (attention)
                    continue
                att = costs.attention(gpu_a, tp_a)
                if att is None:
                    continue
                yield _Evaluator(spec, gpu_a, gpu_e, tp_a, tp_e, epn, att, exp, util, config, costs.label(att, exp))


@dataclass
class SearchResult:
    plans: list[Plan]  # best first
    objective: str
    estimate: bool  # True when any constant came from the roofline
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Plan | None:
        return self.plans[0] if self.plans else None


def _resolve_objective(objective: str, pairs: Sequence[tuple[GPUSpec, GPUSpec]], notes: list[str]) -> str:
    if objective != "auto":
        if objective == "cost" and any(a.price is None or e.price is None for a, e in pairs):
            raise ConfigError(
                "objective 'cost' needs a price for every GPU searched; "
                f"unpriced: {sorted({g.name for p in pairs for g in p if g.price is None})} "
                "(add `price = ...` in a catalog TOML file)"
            )
        return objective
    if all(a.price is not None and e.price is not None for a, e in pairs):
        return "cost"
    unpriced = sorted({g.name for p in pairs for g in p if g.price is None})
    notes.append(f"no price for {', '.join(unpriced)}: ranking by throughput per GPU (add prices in a catalog TOML)")
    return "gpu"


def search(
    spec: ModelSpec,
    attention_gpus: Sequence[GPUSpec],
    expert_gpus: Sequence[GPUSpec] | None = None,
    config: SearchConfig | None = None,
    profile: Profile | None = None,
    *,
    pairs: Sequence[tuple[GPUSpec, GPUSpec]] | None = None,
) -> SearchResult:
    """Algorithm 1 over GPU pairs.

    With ``expert_gpus=None`` the search is homogeneous: each GPU in ``attention_gpus`` serves both
    roles.  Otherwise every attention-GPU x expert-GPU pair is searched (``pairs`` overrides both).
    """
    cfg = config or SearchConfig()
    if pairs is None:
        if expert_gpus is None:
            pairs = [(g, g) for g in attention_gpus]
        else:
            pairs = [(a, e) for a in attention_gpus for e in expert_gpus]
    if not pairs:
        raise ConfigError("no GPUs to search")
    notes: list[str] = []
    objective = _resolve_objective(cfg.objective, pairs, notes)
    costs = CostSource(spec, cfg, profile)
    if profile is not None and profile.model and profile.model.lower() != spec.name.lower():
        notes.append(f"profile was measured for model {profile.model!r}, planning {spec.name!r}")
    plans: list[Plan] = []
    for gpu_a, gpu_e in pairs:
        for ev in _evaluators(spec, gpu_a, gpu_e, cfg, costs):
            for m in range(cfg.min_micro_batches, cfg.max_micro_batches + 1):
                for n_a in ev.n_a_candidates(m):
                    p = ev.plan(n_a, m)
                    if p is not None:
                        plans.append(p)
    if profile is not None and not costs.used:
        raise ConfigError(
            "the profile covers none of the searched configurations: it has attention "
            f"{[(c.gpu or '*', c.tp) for c in profile.attention]} and expert "
            f"{[(c.gpu or '*', c.tp, c.experts_per_node) for c in profile.expert]} "
            "(use --fill-with-roofline to estimate the rest)"
        )
    if not plans:
        notes.append("no feasible plan: weights do not fit or even b_a = 1 misses the SLO")
    plans.sort(key=lambda p: (-p.objective_value(objective), -p.throughput_tok_s, p.num_gpus))
    return SearchResult(plans=plans, objective=objective, estimate="roofline-estimate" in costs.used, notes=notes)


def evaluate(
    spec: ModelSpec,
    gpu_a: GPUSpec,
    gpu_e: GPUSpec,
    *,
    tp_a: int,
    tp_e: int,
    n_a: int,
    micro_batches: int,
    experts_per_node: int = 1,
    b_a: int | None = None,
    config: SearchConfig | None = None,
    profile: Profile | None = None,
) -> Plan | None:
    """One configuration: at ``b_a`` if given, else at the largest ``b_a`` meeting SLO and memory."""
    cfg = config or SearchConfig()
    costs = CostSource(spec, cfg, profile)
    att = costs.attention(gpu_a, tp_a)
    exp = costs.expert(gpu_e, tp_e, experts_per_node)
    if att is None or exp is None:
        return None
    util = (costs.util(gpu_a), costs.util(gpu_e))
    ev = _Evaluator(spec, gpu_a, gpu_e, tp_a, tp_e, experts_per_node, att, exp, util, cfg, costs.label(att, exp))
    return ev.plan(n_a, micro_batches) if b_a is None else ev.plan_at(n_a, micro_batches, b_a)


def sweep(
    spec: ModelSpec,
    around: Plan,
    gpu_a: GPUSpec,
    gpu_e: GPUSpec,
    config: SearchConfig | None = None,
    profile: Profile | None = None,
    n_a_values: Sequence[int] | None = None,
) -> dict[int, list[tuple[int, Plan | None]]]:
    """Best plan for each ``n_a`` and ``m`` at ``around``'s GPUs, TP sizes and experts per node
    (used by the plot).  Returns ``{m: [(n_a, plan or None), ...]}``."""
    cfg = config or SearchConfig()
    if n_a_values is None:
        n_a_values = range(1, max(2 * around.n_a, around.n_a + 6) + 1)
    out: dict[int, list[tuple[int, Plan | None]]] = {}
    for m in range(1, cfg.max_micro_batches + 1):
        out[m] = [
            (
                n_a,
                evaluate(
                    spec,
                    gpu_a,
                    gpu_e,
                    tp_a=around.tp_a,
                    tp_e=around.tp_e,
                    n_a=n_a,
                    micro_batches=m,
                    experts_per_node=around.experts_per_node,
                    config=cfg,
                    profile=profile,
                ),
            )
            for n_a in n_a_values
        ]
    return out


@dataclass(frozen=True)
class HeteroComparison:
    model: str
    best_hetero: Plan | None
    best_homogeneous: Plan | None
    objective: str
    result: SearchResult | None = field(default=None, repr=False, compare=False)  # the full search

    @property
    def gain(self) -> float | None:
        if self.best_hetero is None or self.best_homogeneous is None:
            return None
        return self.best_hetero.objective_value(self.objective) / self.best_homogeneous.objective_value(self.objective)


def compare_hetero(
    specs: Sequence[ModelSpec],
    gpus: Sequence[GPUSpec],
    config: SearchConfig | None = None,
    profile: Profile | None = None,
) -> list[HeteroComparison]:
    """For each model: the best plan with different attention and expert GPUs vs the best with one type."""
    cfg = config or SearchConfig()
    out = []
    for spec in specs:
        res = search(spec, gpus, gpus, cfg, profile)
        het = next((p for p in res.plans if p.heterogeneous), None)
        hom = next((p for p in res.plans if not p.heterogeneous), None)
        out.append(
            HeteroComparison(
                model=spec.name, best_hetero=het, best_homogeneous=hom, objective=res.objective, result=res
            )
        )
    return out
