"""Moving expert weights to a new placement while a cluster serves (``ClusterClient.rebalance``):
expert workers first load the new experts next to the old ones, then every attention worker switches
maps between two steps, then the experts no longer needed are dropped. No request fails and no
output changes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from afdserve.balance.placement import Placement
from afdserve.engine.client import RebalanceResult
from afdserve.errors import WorkerError
from afdserve.runtime.expert_map import ExpertMap
from afdserve.runtime.messages import Ack, CommitMap, PrepareMap, SwitchMap

if TYPE_CHECKING:
    from afdserve.cluster.client import ClusterClient


def move_experts(client: "ClusterClient", slots_per_worker: int | None, planner: str,
                 placement: Placement | None) -> RebalanceResult:
    """``placement``, or one planned from the recent load with ``slots_per_worker`` slots each."""
    client.settle(120.0)  # a membership change under way (its maps) finishes first
    if placement is None:
        from afdserve.balance.planners import plan_janus, plan_megascale

        load = client.expert_load()
        if load is None:
            raise WorkerError("no expert load recorded yet: serve some requests first")
        slots = slots_per_worker or max(client.expert_map.placement.layers[0].capacities)
        placement = (plan_janus if planner == "janus" else plan_megascale)(load, len(client.experts), slots)
    new_map = ExpertMap(placement)
    if new_map.num_workers != len(client.experts) or new_map.num_layers != client.model_cfg.num_layers:
        raise WorkerError(f"placement is for {new_map.num_workers} workers x {new_map.num_layers} layers; "
                          f"the deployment has {len(client.experts)} x {client.model_cfg.num_layers}")
    placement.validate()
    version = client.map_version + 1
    client.call(client.experts, PrepareMap(version, new_map), Ack)
    client.call(client.attention, SwitchMap(version, new_map), Ack)
    client.call(client.experts, CommitMap(version), Ack)
    client.map_version, client.expert_map = version, new_map
    return RebalanceResult(version, [new_map.experts_of(w) for w in range(new_map.num_workers)])
