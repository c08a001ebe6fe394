"""Evaluating deployment plans of one hardware configuration (the inner loops of Algorithm 1).

A :class:`PlanEvaluator` covers one attention-GPU x expert-GPU pair, ``tp_a``, ``tp_e`` and experts
per node: the ``n_a`` candidates of the balance rule, the largest ``b_a`` meeting the SLO (Eq. 7)
and the memory (Eq. 8), and the :class:`~afdserve.planner.plan.Plan` at a point.
:func:`evaluators` yields one for every configuration whose weights fit (lines 2-4).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from afdserve.errors import ConfigError
from afdserve.planner import perf_model as pm
from afdserve.planner.catalog import GPUSpec
from afdserve.planner.cost_source import CostSource
from afdserve.planner.costs import AttentionCost, ExpertCost, UtilCurve
from afdserve.planner.plan import Plan
from afdserve.planner.search_config import SearchConfig
from afdserve.planner.spec import ModelSpec

__all__ = ["PlanEvaluator", "evaluators"]


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


class PlanEvaluator:
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

    def links(self, n_a: int) -> tuple[float, float]:
        """``W_a``, ``W_e`` of Eq. (6): the NICs, or NVLink (per direction) when attention and experts
        are one GPU type and the whole deployment fits in one NVLink domain (e.g. a GB200 NVL72 rack)."""
        g = self.gpu_a
        if g.name == self.gpu_e.name and n_a * self.tp_a + self.n_e * self.tp_e <= g.nvlink_domain:
            return g.intra_node_Bps_per_direction, g.intra_node_Bps_per_direction
        return g.net_Bps, self.gpu_e.net_Bps

    def times(self, b_a: float, n_a: int) -> tuple[float, float, float, float]:
        s = self.spec
        w_a, w_e = self.links(n_a)
        ta = self.k1 * b_a + self.att.k2
        b_e = pm.expert_micro_batch(b_a, n_a, s.top_k, self.n_e)
        te = self.exp.k3 * b_e + self.exp.k4
        tc = pm.comm_time(
            pm.a2e_bytes_per_gpu(b_a, s.hidden_size, s.top_k, self.tp_a, s.act_bytes),
            self.n_e * self.tp_e,
            w_a,
            pm.expert_recv_bytes_per_gpu(b_e, s.hidden_size, self.tp_e, s.act_bytes),
            n_a * self.tp_a,
            w_e,
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
        w_a, w_e = self.links(n_a)
        wa = w_a * ua.peak
        we = w_e * ue.peak
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


def evaluators(
    spec: ModelSpec, gpu_a: GPUSpec, gpu_e: GPUSpec, config: SearchConfig, costs: CostSource
) -> Iterable[PlanEvaluator]:
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
                yield PlanEvaluator(spec, gpu_a, gpu_e, tp_a, tp_e, epn, att, exp, util, config, costs.label(att, exp))
