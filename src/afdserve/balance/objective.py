"""The two placement objectives, as per-worker costs of one layer.

Both are of the form ``cost(g) = sum_{i in g} unary[i] + sum_{i<j in g} pair[i, j]`` over the experts
``i`` held by worker ``g``, with coefficients that depend on the replica counts ``r``:

* ``"megascale"`` (MegaScale-Infer §6): ``C_g = sum_i x_ig * max(a_i, K)`` with ``a_i`` the expert's
  tokens per step, ``K`` the cost floor of a cold expert (``cold_cost``, in tokens per step) and
  ``x_ig`` the fraction of expert ``i``'s tokens served by worker ``g``. The objective takes the
  best fractions for the placement (:mod:`afdserve.balance.shares`, exact); the planners' inner
  loops use the even split ``x_ig = 1 / r_i`` as a proxy: ``unary[i] = max(a_i, K) / r_i``.
* ``"janus"`` (JANUS co-activation placement): ``I(g) = sum over pairs {i, j} of experts on g, i = j
  included, of a_ij / (r_i * r_j)``, where ``a_ij`` (i != j) is how many tokens per step chose both
  and ``a_ii = c_i`` how many chose ``i`` (the co-activation Gram matrix; its diagonal makes the
  worker's own token load part of ``I(g)``), and a replica of ``i`` sees ``1 / r_i`` of its tokens.
  So ``unary[i] = c_i / r_i**2`` and ``pair[i, j] = a_ij / (r_i * r_j)``.

A layer's objective is ``max_g cost(g)``; a placement's is the sum over layers (layers run one
after another, each as slow as its slowest worker).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from afdserve.balance.load import LoadSnapshot
from afdserve.balance.placement import EMPTY, LayerPlacement, Placement
from afdserve.balance.shares import optimal_shares
from afdserve.errors import ConfigError

Kind = Literal["megascale", "janus"]
KINDS: tuple[Kind, ...] = ("megascale", "janus")


def layer_load(snapshot: LoadSnapshot, layer: int, kind: Kind, cold_cost: float = 0.0) -> tuple[np.ndarray, np.ndarray | None]:
    """(per-expert load [E], co-activations per step [E, E] or None) of one layer for ``kind``.

    The per-expert load is what replicas are handed out by: ``max(a_i, K)`` for megascale, the
    activations ``c_i`` (tokens per step) for janus.
    """
    tokens = snapshot.tokens_per_step()[layer]
    if kind == "megascale":
        return np.maximum(tokens, float(cold_cost)), None
    if kind == "janus":
        if snapshot.coactivation is None:
            raise ConfigError("the janus objective needs co-activation counts; the snapshot has none")
        return tokens.astype(np.float64), snapshot.coactivation_per_step()[layer]
    raise ConfigError(f"unknown objective kind {kind!r}; expected one of {KINDS}")


def cost_model(load: np.ndarray, coact: np.ndarray | None, replicas: np.ndarray, kind: Kind) -> tuple[np.ndarray, np.ndarray | None]:
    """(unary [E], pair [E, E] or None) for replica counts ``replicas`` (see the module docstring;
    for megascale this is the even-split proxy)."""
    r = np.maximum(replicas.astype(np.float64), 1.0)
    if kind == "megascale":
        return load / r, None
    assert coact is not None
    pair = coact / np.outer(r, r)
    np.fill_diagonal(pair, 0.0)
    return load / (r * r), pair


def worker_costs(lp: LayerPlacement, load: np.ndarray, coact: np.ndarray | None, kind: Kind) -> np.ndarray:
    """float64 [N]: each worker's cost in one layer (megascale: under the placement's shares, or the
    optimal ones when it has none)."""
    if kind == "megascale":
        costs = np.zeros(lp.num_workers)
        if lp.shares is not None:  # the plan's own x_ig
            for g, (worker, fractions) in enumerate(zip(lp.slots, lp.shares)):
                costs[g] = sum(x * float(load[e]) for e, x in zip(worker, fractions) if e != EMPTY)
            return costs
        replicas = [lp.replicas_of(e) for e in range(lp.num_experts)]
        _, shares = optimal_shares(replicas, load, lp.num_workers)
        for i, s in enumerate(shares):
            for g, f in s.items():
                costs[g] += f * float(load[i])
        return costs
    unary, pair = cost_model(load, coact, lp.replica_counts(), kind)
    out = np.zeros(lp.num_workers)
    for w, worker in enumerate(lp.slots):
        held = np.array([e for e in worker if e != EMPTY], dtype=np.int64)
        if held.size == 0:
            continue
        c = float(unary[held].sum())
        if pair is not None:
            c += float(pair[np.ix_(held, held)].sum()) / 2.0
        out[w] = c
    return out


def layer_objectives(placement: Placement, snapshot: LoadSnapshot, kind: Kind = "megascale", *, cold_cost: float = 0.0) -> list[float]:
    """``max_g cost(g)`` of every layer."""
    _check_shapes(placement, snapshot)
    out = []
    for layer, lp in enumerate(placement.layers):
        load, coact = layer_load(snapshot, layer, kind, cold_cost)
        out.append(float(worker_costs(lp, load, coact, kind).max()))
    return out


def objective(placement: Placement, snapshot: LoadSnapshot, kind: Kind = "megascale", *, cold_cost: float = 0.0) -> float:
    """Sum over layers of the slowest worker's cost (lower is better)."""
    return float(sum(layer_objectives(placement, snapshot, kind, cold_cost=cold_cost)))


def _check_shapes(placement: Placement, snapshot: LoadSnapshot) -> None:
    if placement.num_layers != snapshot.num_layers or placement.num_experts != snapshot.num_experts:
        raise ConfigError(
            f"placement is {placement.num_layers} layers x {placement.num_experts} experts, "
            f"snapshot is {snapshot.num_layers} x {snapshot.num_experts}"
        )
