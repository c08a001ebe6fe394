"""Resizing a cluster's pools while it serves (JANUS's independent scaling of attention and experts),
with the membership epochs that replace a lost worker (``afdserve.cluster.supervisor``).

One resize is one new epoch: removed workers stop, added ones start in the epoch's M2N group, the
others keep their processes, weights, caches and requests and only connect their links anew
(``Regroup``). When the expert pool changes, the balance planner re-places the experts over the new
pool (from the recent load; contiguously before there is any) and the new map travels with the
``Regroup``, so every step runs wholly on the old map or wholly on the new one. A removed attention
worker's requests move to the others: prompt plus the tokens already delivered, recomputed.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from afdserve.config import MAX_POOL_WORKERS
from afdserve.engine.client import ScaleResult
from afdserve.errors import ConfigError, WorkerError
from afdserve.runtime.expert_map import ExpertMap
from afdserve.runtime.messages import AddRequest, Regroup, Shutdown, worker_name

if TYPE_CHECKING:
    from afdserve.cluster.client import ClusterClient

def check_pool_sizes(attention_workers: int, expert_workers: int, num_experts: int) -> None:
    if not 1 <= attention_workers <= MAX_POOL_WORKERS:
        raise ConfigError(f"invalid attention_workers={attention_workers}: must be in 1..{MAX_POOL_WORKERS}")
    if not 1 <= expert_workers <= min(num_experts, MAX_POOL_WORKERS):
        raise ConfigError(f"invalid expert_workers={expert_workers}: must be in 1..{min(num_experts, MAX_POOL_WORKERS)}"
                          f" (the model has {num_experts} experts)")


def plan_expert_pool(c: "ClusterClient", workers: int) -> ExpertMap:
    """The expert map over ``workers`` expert workers: the JANUS planner over the recent load, with
    as many slots per worker as now (at least enough to hold every expert), or contiguous ranges
    while no load has been recorded."""
    from afdserve.balance.planners import plan_janus

    cfg = c.model_cfg
    load = c.expert_load()
    if load is None or load.steps == 0:
        return ExpertMap.contiguous(cfg.num_layers, cfg.num_experts, workers)
    slots = min(cfg.num_experts, max(math.ceil(cfg.num_experts / workers),
                                     max(c.expert_map.placement.layers[0].capacities)))
    placement = plan_janus(load, workers, slots)
    placement.validate()
    return ExpertMap(placement)


def scale(c: "ClusterClient", attention_workers: int | None, expert_workers: int | None,
          timeout: float) -> ScaleResult:
    """Resizes ``c``'s pools to the given sizes (None: unchanged) and waits until every worker of the
    new membership is ready. No request fails; greedy outputs do not change."""
    n_a = len(c.attention) if attention_workers is None else attention_workers
    n_e = len(c.experts) if expert_workers is None else expert_workers
    check_pool_sizes(n_a, n_e, c.model_cfg.num_experts)
    if not c.can_replace:
        raise ConfigError("this deployment cannot start workers while it serves (its launcher cannot replace them)")
    if c.pd is not None and n_a != len(c.attention):
        raise ConfigError("a prefill/decode deployment's attention pools are not resized while it serves")
    if n_a < c.config.context_parallel_size:
        raise ConfigError(f"invalid attention_workers={n_a}: context-parallel prefill splits prompts over "
                          f"{c.config.context_parallel_size} attention workers")
    t0 = time.monotonic()
    c.settle(timeout)  # a recovery or resize under way finishes first
    if (n_a, n_e) == (len(c.attention), len(c.experts)):
        return ScaleResult(n_a, n_e, c.membership.epoch, c.map_version, time.monotonic() - t0,
                           [c.expert_map.experts_of(w) for w in range(n_e)])
    new_map = plan_expert_pool(c, n_e) if n_e != len(c.experts) else None
    removed = c.attention[n_a:] + c.experts[n_e:]
    again = c.cp.withdraw(c.attention[n_a:]) if c.cp is not None else []  # CP prefills with a leaving rank
    moved = [rid for rid, owner in c.owner.items() if owner in c.attention[n_a:]]
    sent = {rid: c.delivered(rid) for rid in moved}  # read before the removed workers' outputs are dropped
    for name in removed:  # they stop: nothing more is read from them
        w = c.workers.pop(name)
        w.send(Shutdown())
        w.join(5.0)
        c.specs.pop(name)
        c.stats_view.latest.pop(name, None)
        c.stats_view.busy.pop(name, None)
    for name in c.attention[n_a:]:
        c.balancer.remove_worker(name)
        if c.routes is not None:
            c.routes.drop(name)
    added = [worker_name("attention", i) for i in range(len(c.attention), n_a)] + \
            [worker_name("expert", j) for j in range(len(c.experts), n_e)]
    del c.attention[n_a:], c.experts[n_e:]
    c.attention += [n for n in added if n.startswith("attention")]
    c.experts += [n for n in added if n.startswith("expert")]
    c.config = replace(c.config, attention_workers=n_a, expert_workers=n_e, expert_split=None)
    if new_map is not None:
        c.expert_map, c.map_version = new_map, c.map_version + 1
    survivors = list(c.workers)
    rec = c.membership.resize(added, removed, survivors)
    group = c.membership.group_of(rec.epoch)
    for n in survivors:
        c.workers[n].send(Regroup(rec.epoch, group, n_a, n_e, new_map, c.map_version))
    template = next(iter(c.specs.values()))
    for name in added:
        role, index = ("attention", int(name[9:])) if name.startswith("attention") else ("expert", int(name[6:]))
        spec = replace(template, role=role, index=index, config=c.config, group=group, epoch=rec.epoch,
                       expert_map=c.expert_map, map_version=c.map_version)
        c.specs[name] = spec
        c.workers[name] = c.launch_worker(spec)
        if role == "attention":
            c.balancer.add_worker(name)
            if c.routes is not None:
                c.routes.forget(name)  # a new process: its prefix cache is empty
    for rid in moved:  # a removed attention worker's requests: recomputed elsewhere, none repeats
        prompt, params = c.requests[rid]
        target = c.balancer.pick(len(prompt) + len(sent[rid]), params.max_tokens - len(sent[rid]))
        c.owner[rid] = target
        c.balancer.add(target, rid, c.lengths[rid])
        c.workers[target].send(AddRequest(rid, prompt, params, sent[rid]))
        if c.routes is not None:  # recomputed there: its prompt blocks will be cached there
            c.routes.add(target, c.routes.key(prompt))
    if c.cp is not None:  # ... start over on the new pool
        c.cp.resubmit(again)
    c.settle(timeout)
    if c.failed:
        raise WorkerError(f"deployment failed while resizing: {c.failed}")
    return ScaleResult(n_a, n_e, rec.epoch, c.map_version, time.monotonic() - t0,
                       [c.expert_map.experts_of(w) for w in range(n_e)])
