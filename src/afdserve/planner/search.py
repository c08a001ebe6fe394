"""Deployment-plan search (MegaScale-Infer Algorithm 1), homogeneous or heterogeneous.

For every attention-GPU x expert-GPU pair, every ``tp_e`` and ``tp_a`` whose weights fit (line 4),
and every ``experts_per_node`` (1 in the paper; more lets fine-grained MoEs share a node), we take
``n_a`` from the balance rule (constraint 1) and its neighbours, try ``m = 1 .. N_m``
micro-batches, and binary-search the largest per-attention-node micro-batch ``b_a`` whose
iteration time meets the SLO (Eq. 7) and whose KV cache fits (Eq. 8).  Plans are ranked by
throughput per cost (or per GPU / per watt).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from afdserve.errors import ConfigError
from afdserve.planner.catalog import GPUSpec
from afdserve.planner.cost_source import CostSource
from afdserve.planner.evaluator import PlanEvaluator, evaluators
from afdserve.planner.plan import Plan
from afdserve.planner.profile import Profile
from afdserve.planner.search_config import SearchConfig
from afdserve.planner.spec import ModelSpec

__all__ = ["SearchResult", "search", "evaluate", "sweep", "HeteroComparison", "compare_hetero"]


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
        for ev in evaluators(spec, gpu_a, gpu_e, cfg, costs):
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
    ev = PlanEvaluator(spec, gpu_a, gpu_e, tp_a, tp_e, experts_per_node, att, exp, util, cfg, costs.label(att, exp))
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
