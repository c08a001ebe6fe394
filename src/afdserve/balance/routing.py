"""Replica routing: which worker serves each (token, expert) routing of a batch.

Policy ``"activated"`` (default, JANUS-style): on memory-bound expert workers a layer's time
follows the number of *distinct* experts a worker runs, so each activated logical expert of the
batch is served by exactly one of its replicas, chosen to balance activated experts per worker:

1. experts with a single replica go to their worker (no choice);
2. the replicated experts of the batch, in a fixed order (fewest replicas first, then most tokens in
   this batch, then lowest id), each go to the replica worker with the fewest activated experts so
   far (ties: fewest tokens so far, then lowest worker id).

Within one batch every token of an expert goes to the same replica (a second replica would be one
more weight read); from batch to batch the choice moves, so over time an expert's tokens spread
over its replicas.

Policy ``"shares"`` (MegaScale-Infer-style, for compute-bound batches): the tokens of a replicated
expert are split over its replicas in the placement's planned fractions ``x_ig`` (even when it has
none), in token order: with ``c`` tokens of the expert in the batch, its ``j``-th token goes to the
replica whose cumulative share interval holds ``(j + 0.5) / c``.

Either way the result depends only on ``topk_ids`` and the placement, so every worker that sees the
same batch computes the same routing without exchanging anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from afdserve.balance.placement import LayerPlacement
from afdserve.errors import ConfigError


@dataclass(frozen=True)
class ReplicaTable:
    """Per-layer lookup tables for :func:`route_replicas` (built once per placement, cached on it)."""

    num_workers: int
    first: np.ndarray  # int64 [E]: lowest worker holding the expert
    single: np.ndarray  # bool [E]: exactly one replica
    num_replicas: np.ndarray  # int64 [E]
    replicas: list[list[int]]  # per expert, its workers ascending
    padded: np.ndarray  # int64 [E, R]: replicas, padded with the last one
    cum_shares: np.ndarray  # float64 [E, R]: cumulative token shares of the replicas (last = 1)
    share_bounds: np.ndarray  # float64 [E * R]: cum_shares[e] + e, flattened (non-decreasing)

    @staticmethod
    def of(lp: LayerPlacement) -> "ReplicaTable":
        table = lp._cache.get("replica_table")
        if table is None:
            reps = [list(lp.replicas_of(e)) for e in range(lp.num_experts)]
            if any(not r for r in reps):
                missing = [e for e, r in enumerate(reps) if not r]
                raise ConfigError(f"cannot route: experts {missing[:8]} have no replica")
            nrep = np.array([len(r) for r in reps], dtype=np.int64)
            width = int(nrep.max())
            padded = np.array([r + [r[-1]] * (width - len(r)) for r in reps], dtype=np.int64)
            cum = np.ones((lp.num_experts, width))
            for e, r in enumerate(reps):
                c = np.cumsum([lp.share(w, e) for w in r])
                cum[e, : len(r)] = c / c[-1] if c[-1] > 0 else np.arange(1, len(r) + 1) / len(r)
                cum[e, len(r) - 1 :] = 1.0
            table = ReplicaTable(
                num_workers=lp.num_workers,
                first=np.array([r[0] for r in reps], dtype=np.int64),
                single=nrep == 1,
                num_replicas=nrep,
                replicas=reps,
                padded=padded,
                cum_shares=cum,
                share_bounds=(cum + np.arange(lp.num_experts)[:, None]).reshape(-1),
            )
            lp._cache["replica_table"] = table
        return table


Policy = Literal["activated", "shares"]


def route_replicas(topk_ids: torch.Tensor, placement_for_layer: LayerPlacement, *, policy: Policy = "activated") -> torch.Tensor:
    """int64 [T, k] (CPU): the worker serving each entry of ``topk_ids`` [T, k] (logical expert ids).

    Runs on the host; CUDA ids are copied to the host first (one synchronisation).
    """
    ids = topk_ids.detach()
    if ids.device.type != "cpu":
        ids = ids.cpu()
    flat = ids.reshape(-1).numpy()
    worker = route_replicas_numpy(flat, placement_for_layer, policy=policy)
    return torch.from_numpy(worker).view(ids.shape)


def route_replicas_numpy(flat_ids: np.ndarray, placement_for_layer: LayerPlacement, *, policy: Policy = "activated") -> np.ndarray:
    """:func:`route_replicas` on a flat integer array; returns int64 workers of the same length."""
    table = ReplicaTable.of(placement_for_layer)
    num_experts = len(table.first)
    if flat_ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    lo, hi = int(flat_ids.min()), int(flat_ids.max())
    if lo < 0 or hi >= num_experts:
        raise ConfigError(f"expert ids must be in [0, {num_experts}), got {lo}..{hi}")
    counts = np.bincount(flat_ids, minlength=num_experts)
    if policy == "shares":
        return _split_by_shares(flat_ids, counts, table)
    if policy != "activated":
        raise ConfigError(f"unknown routing policy {policy!r}; expected 'activated' or 'shares'")
    active = counts > 0
    single = active & table.single
    multi = np.flatnonzero(active & ~table.single)
    choice = table.first
    if multi.size:
        n = table.num_workers
        scale = int(flat_ids.size) + 1  # activations dominate, tokens break ties
        # per worker: activated experts * scale + tokens, from the single-replica experts
        key = np.bincount(table.first[single], weights=counts[single] + scale, minlength=n).astype(np.int64).tolist()
        multi = multi[np.lexsort((multi, -counts[multi], table.num_replicas[multi]))]
        reps = table.replicas
        least = key.__getitem__
        picked = []
        pick = picked.append
        for e, inc in zip(multi.tolist(), (counts[multi] + scale).tolist()):
            w = min(reps[e], key=least)
            key[w] += inc
            pick(w)
        choice = choice.copy()
        choice[multi] = picked
    return choice[flat_ids]


def _split_by_shares(flat_ids: np.ndarray, counts: np.ndarray, table: ReplicaTable) -> np.ndarray:
    out = table.first[flat_ids]
    idx = np.flatnonzero(~table.single[flat_ids])  # entries of replicated experts
    if idx.size == 0:
        return out
    ids = flat_ids[idx]
    order = np.argsort(ids, kind="stable")
    multi_counts = np.where(table.single, 0, counts)
    starts = np.cumsum(multi_counts) - multi_counts
    rank = np.empty(ids.size, dtype=np.int64)  # position among the expert's entries, in token order
    rank[order] = np.arange(ids.size) - starts[ids[order]]
    # cum_shares rows shifted by the expert id form one sorted array: one searchsorted for all
    pos = np.searchsorted(table.share_bounds, ids + (rank + 0.5) / counts[ids])
    out[idx] = table.padded.reshape(-1)[np.minimum(pos, (ids + 1) * table.padded.shape[1] - 1)]
    return out


@dataclass(frozen=True)
class DeviceTable:
    """A layer's :class:`ReplicaTable` as tensors on one device (for :func:`route_replicas_device`)."""

    first: torch.Tensor  # int64 [E]
    single: torch.Tensor  # bool [E]
    num_replicas: torch.Tensor  # int64 [E]
    padded: torch.Tensor  # int64 [E, R]
    multi: int  # how many experts have more than one replica
    num_workers: int

    @staticmethod
    def of(lp: LayerPlacement, device: torch.device) -> "DeviceTable":
        key = f"device_table:{device}"
        table = lp._cache.get(key)
        if table is None:
            t = ReplicaTable.of(lp)
            table = DeviceTable(*(torch.from_numpy(np.ascontiguousarray(a)).to(device)
                                  for a in (t.first, t.single, t.num_replicas, t.padded)),
                                multi=int((~t.single).sum()), num_workers=t.num_workers)
            lp._cache[key] = table
        return table


def route_replicas_device(topk_ids: torch.Tensor, placement_for_layer: LayerPlacement) -> torch.Tensor:
    """:func:`route_replicas` with the ``"activated"`` policy, computed where ``topk_ids`` live by
    tensor ops alone (no host read: the ids, counts and choices stay on the device). The greedy
    choice is the same, step for step: the replicated experts are visited in the same order (all of
    them, a fixed number of steps; those the batch does not activate change nothing), each taking
    the replica with the smallest key, the lowest worker on ties."""
    t = DeviceTable.of(placement_for_layer, topk_ids.device)
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_experts = t.first.numel()
    # index_add_ rather than bincount: CUDA's bincount reads the largest id back to the host
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    if t.multi == 0:
        return t.first[flat].view(topk_ids.shape)
    scale = flat.numel() + 1  # activations dominate, tokens break ties
    inc = torch.where(counts > 0, counts + scale, 0)
    key = torch.zeros(t.num_workers, dtype=torch.int64, device=flat.device)
    key = key.index_add(0, t.first, torch.where(t.single, inc, 0))
    # the visiting order: fewest replicas first, then most tokens, then lowest id (one sort key)
    ids = torch.arange(num_experts, device=flat.device)
    order_key = (t.num_replicas * scale + (scale - 1 - counts)) * num_experts + ids
    order_key = torch.where(t.single, torch.iinfo(torch.int64).max, order_key)
    visit = torch.argsort(order_key)[: t.multi]
    choice = t.first.clone()
    for i in range(t.multi):
        e = visit[i]
        reps = t.padded[e]
        w = reps[torch.argmin(key[reps])]
        key = key.index_add(0, w.view(1), inc[e].view(1))
        choice = choice.index_put((e.view(1),), w.view(1))
    return choice[flat].view(topk_ids.shape)


def activated_per_worker(topk_ids: torch.Tensor, workers: torch.Tensor, num_workers: int, num_experts: int) -> torch.Tensor:
    """int64 [N]: distinct experts each worker runs for a batch routed as ``workers`` (same shape)."""
    pairs = torch.unique(workers.reshape(-1).to(torch.int64) * num_experts + topk_ids.reshape(-1).to(torch.int64))
    return torch.bincount(pairs // num_experts, minlength=num_workers)


def tokens_per_worker(workers: torch.Tensor, num_workers: int) -> torch.Tensor:
    """int64 [N]: (token, expert) routings each worker serves."""
    return torch.bincount(workers.reshape(-1).to(torch.int64), minlength=num_workers)
