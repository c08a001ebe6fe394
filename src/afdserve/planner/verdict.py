"""AFD or not: the best plan of each family at the SLO, the winner, and why in one line.

:func:`compare_families` runs the AFD search (:func:`afdserve.planner.search.search`) and the
colocated families (:mod:`afdserve.planner.alternatives`) on the same GPUs, SLO and ``s``, all on
roofline costs, and ranks the families' best plans by throughput per cost (per GPU when a GPU has
no price). :func:`reason` explains the winner against the runner-up from their numbers:

* if the runner-up's batch is memory-limited and its fewer resident requests per GPU account for
  at least half of the gain (in log terms): *memory-limited batch*;
* otherwise the term of GPU-seconds per output token (:data:`~afdserve.planner.alternatives.TERMS`)
  by which the runner-up exceeds the winner the most: expert weights streamed for few tokens
  (*too few tokens per expert*), communication (*bandwidth-bound dispatch/combine*, all-reduce or
  A2E/E2A), attention, expert compute, or idle time (AFD's pipeline waiting on its slower side).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from afdserve.errors import ConfigError
from afdserve.planner.alternatives import AltConfig, FamilyPlan, afd_family_plan, tp_plans, wide_ep_plans
from afdserve.planner.catalog import GPUSpec
from afdserve.planner.search import search
from afdserve.planner.search_config import SearchConfig
from afdserve.planner.spec import ModelSpec

__all__ = ["Comparison", "compare_families", "reason"]


@dataclass(frozen=True)
class Comparison:
    """The best plan of each family (best first), the objective and the one-line reason."""

    model: str
    objective: str  # "cost" | "gpu"
    best: list[FamilyPlan]  # one per family that has a feasible plan, best first
    reason: str
    notes: list[str] = field(default_factory=list)

    @property
    def winner(self) -> FamilyPlan | None:
        return self.best[0] if self.best else None

    def family(self, name: str) -> FamilyPlan | None:
        return next((p for p in self.best if p.family == name), None)

    def gain(self, family: str, over: str) -> float | None:
        """``family``'s objective over ``over``'s (None if either has no plan)."""
        a, b = self.family(family), self.family(over)
        if a is None or b is None:
            return None
        return a.objective_value(self.objective) / b.objective_value(self.objective)

    def to_json(self) -> dict[str, object]:
        w = self.winner
        return {"model": self.model, "objective": self.objective, "winner": None if w is None else w.family,
                "reason": self.reason, "families": [p.to_json() for p in self.best], "notes": self.notes}


_PHRASES = {
    "attention": "attention costs more per token in {loser} ({lo:.1f} vs {wi:.1f} GPU-us/token)",
    "expert_compute": "expert GEMMs cost more per token in {loser} ({lo:.1f} vs {wi:.1f} GPU-us/token)",
    "idle": "{loser} GPUs idle {lo:.1f} GPU-us/token (vs {wi:.1f}) waiting on the slower side",
}


def reason(winner: FamilyPlan, loser: FamilyPlan | None, objective: str) -> str:
    """Why ``winner`` beats ``loser`` (see the module docstring), in one line."""
    if loser is None:
        return f"{winner.family} is the only family with a plan meeting the SLO"
    gain = winner.objective_value(objective) / loser.objective_value(objective)
    head = f"{winner.family} {gain:.2f}x over {loser.family}"
    req = winner.requests_per_gpu / loser.requests_per_gpu
    if loser.limit == "memory" and req > 1 and math.log(req) >= 0.5 * math.log(max(gain, 1.0 + 1e-9)):
        held = (f"KV on {loser.kv_gpus} of its {loser.num_gpus} GPUs" if loser.kv_gpus < loser.num_gpus
                else f"{loser.weights_gb_per_gpu:.0f} GB of weights/GPU")
        return (f"{head}: memory-limited batch: {loser.family} holds {loser.requests_per_gpu:.0f} requests/GPU "
                f"({held}) vs {winner.requests_per_gpu:.0f}, "
                f"TBT {loser.tbt_s * 1e3:.0f} vs {winner.tbt_s * 1e3:.0f} ms")
    diff = {k: loser.terms.get(k, 0.0) - winner.terms.get(k, 0.0) for k in loser.terms}
    term = max(diff, key=lambda k: diff[k])
    lo, wi = loser.terms.get(term, 0.0) * 1e6, winner.terms.get(term, 0.0) * 1e6
    afd_waits_on_links = loser.plan is not None and not loser.plan.comm_hidden
    if term == "expert_weights":
        why = (f"too few tokens per expert in {loser.family}: {loser.tokens_per_expert:.0f} per expert and layer, "
               f"streaming expert weights costs {lo:.1f} vs {wi:.1f} GPU-us/token")
    elif term == "communication" or (term == "idle" and (loser.family == "wide-ep" or afd_waits_on_links)):
        what = loser.sync if term == "communication" and loser.sync else loser.comm
        why = f"bandwidth-bound {what} in {loser.family} ({lo:.1f} vs {wi:.1f} GPU-us/token)"
    else:
        why = _PHRASES[term].format(loser=f"{loser.family} on {loser.gpus}", lo=lo, wi=wi)
    if loser.limit == "memory" and req > 1:
        why += f"; its batch memory-limited ({loser.requests_per_gpu:.0f} vs {winner.requests_per_gpu:.0f} req/GPU)"
    return f"{head}: {why}"


def _objective(gpus: Sequence[GPUSpec], requested: str) -> str:
    if requested in ("cost", "gpu"):
        if requested == "cost" and any(g.price is None for g in gpus):
            raise ConfigError(f"objective 'cost' needs prices; unpriced: {[g.name for g in gpus if g.price is None]}")
        return requested
    if requested == "watt":
        raise ConfigError("the family comparison ranks by throughput per cost or per GPU, not per watt")
    return "cost" if all(g.price is not None for g in gpus) else "gpu"


def compare_families(
    spec: ModelSpec,
    gpus: Sequence[GPUSpec],
    config: SearchConfig | None = None,
    alt: AltConfig | None = None,
    *,
    expert_gpus: Sequence[GPUSpec] | None = None,
) -> Comparison:
    """The best plan of each family on ``gpus`` (AFD: every attention x expert pair of ``gpus`` and
    ``expert_gpus`` when given; the colocated families on each of ``gpus``), ranked."""
    cfg = config or SearchConfig()
    alt = alt or AltConfig()
    if not gpus:
        raise ConfigError("no GPUs to compare on")
    all_gpus = list(dict.fromkeys([*gpus, *(expert_gpus or [])]))
    objective = _objective(all_gpus, cfg.objective)
    notes: list[str] = []
    if objective == "gpu" and cfg.objective == "auto":
        notes.append(f"no price for {', '.join(g.name for g in all_gpus if g.price is None)}: ranking per GPU")
    found: list[FamilyPlan] = []
    if "afd" in alt.families:
        res = search(spec, list(gpus), None if expert_gpus is None else list(expert_gpus), cfg)
        by_name = {g.name: g for g in all_gpus}
        if res.best is not None:
            p = max(res.plans, key=lambda q: q.objective_value(objective))
            found.append(afd_family_plan(spec, p, by_name[p.attention_gpu], by_name[p.expert_gpu], cfg))
    for gpu in gpus:
        if "wide-ep" in alt.families:
            found.extend(wide_ep_plans(spec, gpu, cfg, alt))
        if "tp" in alt.families:
            found.extend(tp_plans(spec, gpu, cfg, alt))
    best: dict[str, FamilyPlan] = {}
    for p in sorted(found, key=lambda q: (-q.objective_value(objective), q.num_gpus)):
        best.setdefault(p.family, p)
    ranked = list(best.values())
    for f in alt.families:
        if f not in best:
            notes.append(f"{f}: no plan meets the SLO with the weights and one request in memory")
    why = "no family has a plan meeting the SLO" if not ranked else reason(
        ranked[0], ranked[1] if len(ranked) > 1 else None, objective)
    return Comparison(spec.name, objective, ranked, why, notes)
