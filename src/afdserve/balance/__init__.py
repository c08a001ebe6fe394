"""Expert load balancing: load tracking, replica placement planners, replica routing.

* :mod:`.load` — :class:`LoadTracker` (on the workers) and :class:`LoadSnapshot` (JSON, mergeable)
* :mod:`.placement` — :class:`Placement` / :class:`LayerPlacement` (slot -> logical expert), baseline
* :mod:`.objective` — the MegaScale-Infer and JANUS per-worker costs
* :mod:`.planners` — :func:`plan_megascale`, :func:`plan_janus`
* :mod:`.exact` — :func:`plan_exact` (exhaustive, small instances)
* :mod:`.routing` — :func:`route_replicas` (per-batch replica choice)
* :mod:`.heatmap`, :mod:`.cli`, :mod:`.metrics` — Fig.-16-style heatmap, ``afdserve expert-load``, Prometheus
* :mod:`.synthetic` — skewed, co-activated synthetic routing for tests and benchmarks
"""

from afdserve.balance.exact import plan_exact
from afdserve.balance.load import LoadSnapshot, LoadTracker
from afdserve.balance.objective import layer_objectives, objective
from afdserve.balance.placement import (
    EMPTY,
    LayerPlacement,
    Placement,
    SlotChange,
    align_slots,
    round_robin,
    round_robin_layer,
    slot_changes,
    slots_from_memory,
)
from afdserve.balance.planners import plan_janus, plan_megascale, replica_counts
from afdserve.balance.routing import route_replicas

__all__ = [
    "EMPTY",
    "LayerPlacement",
    "LoadSnapshot",
    "LoadTracker",
    "Placement",
    "SlotChange",
    "align_slots",
    "layer_objectives",
    "objective",
    "plan_exact",
    "plan_janus",
    "plan_megascale",
    "replica_counts",
    "round_robin",
    "round_robin_layer",
    "route_replicas",
    "slot_changes",
    "slots_from_memory",
]
