"""Exact placement by exhaustive search, for small instances (tests and the planners' gap report).

Every worker gets any set of at most ``capacities[w]`` distinct experts; placements that leave an
expert without a replica are dropped and the rest are scored with the same objective as the
planners (:mod:`afdserve.balance.objective`), replica counts following from the placement and, for
MegaScale-Infer, the best token shares computed in closed form over worker subsets. Workers
of equal capacity are interchangeable, so only one ordering of their sets is enumerated. Scoring is
vectorised over chunks of candidate placements.
"""

from __future__ import annotations

import itertools
from math import comb
from typing import Iterator, Literal, Sequence

import numpy as np

from afdserve.balance.load import LoadSnapshot
from afdserve.balance.objective import Kind, layer_load
from afdserve.balance.placement import EMPTY, LayerPlacement, Placement, capacities_of
from afdserve.balance.planners import replica_counts
from afdserve.errors import ConfigError

_CHUNK = 4_096


def count_candidates(num_experts: int, capacities: Sequence[int], *, fill: bool = False) -> int:
    """Number of placements :func:`plan_exact` enumerates for one layer (``fill``: ``replicas="fill"``)."""
    total = 1
    for cap, size in _groups(capacities):
        top = min(cap, num_experts)
        nsub = sum(comb(num_experts, s) for s in range(top + 1) if not fill or s == top)
        total *= comb(nsub + size - 1, size)
    return total


def plan_exact(
    snapshot: LoadSnapshot,
    num_workers: int,
    slots_per_worker: int | Sequence[int],
    *,
    kind: Kind = "megascale",
    cold_cost: float = 0.0,
    replicas: Literal["free", "fill", "rule"] = "free",
    max_candidates: int = 5_000_000,
) -> Placement:
    """The placement minimising ``kind``'s objective in every layer.

    ``replicas`` restricts the replica counts: ``"free"`` any, ``"fill"`` any that use every slot
    (``min(C_w, E)`` experts on each worker, like the planners), ``"rule"`` exactly the counts the
    planners use (:func:`~afdserve.balance.planners.replica_counts`), which isolates the quality of
    their assignment step. Raises ``ConfigError`` when a layer has more than ``max_candidates``
    placements.
    """
    if replicas not in ("free", "fill", "rule"):
        raise ConfigError(f"replicas must be 'free', 'fill' or 'rule', got {replicas!r}")
    caps = capacities_of(num_workers, slots_per_worker)
    e = snapshot.num_experts
    if sum(caps) < e:
        raise ConfigError(f"{e} experts do not fit in {sum(caps)} slots ({caps})")
    n = count_candidates(e, caps, fill=replicas != "free")
    if n > max_candidates:
        raise ConfigError(f"exact search over {n} placements exceeds max_candidates={max_candidates}")
    layers = []
    for layer in range(snapshot.num_layers):
        load, coact = layer_load(snapshot, layer, kind, cold_cost)
        want = replica_counts(load, caps) if replicas == "rule" else None
        layers.append(_exact_layer(load, coact, kind, caps, want, fill=replicas == "fill"))
    return Placement(tuple(layers))


def _groups(capacities: Sequence[int]) -> list[tuple[int, int]]:
    """(capacity, number of workers) for each distinct capacity, in first-seen order."""
    out: dict[int, int] = {}
    for c in capacities:
        out[int(c)] = out.get(int(c), 0) + 1
    return list(out.items())


def _exact_layer(
    load: np.ndarray, coact: np.ndarray | None, kind: Kind, caps: tuple[int, ...], want: np.ndarray | None, fill: bool
) -> LayerPlacement:
    num_experts = len(load)
    groups = _groups(caps)
    subsets = {
        cap: [
            s
            for k in range(min(cap, num_experts) + 1)
            if not fill or k == min(cap, num_experts)
            for s in itertools.combinations(range(num_experts), k)
        ]
        for cap, _ in groups
    }
    masks = {cap: np.array([[e in s for e in range(num_experts)] for s in subs], dtype=np.float64) for cap, subs in subsets.items()}
    # worker order of the enumeration: all workers of the first group, then the next group...
    worker_caps = [cap for cap, size in groups for _ in range(size)]
    best_val, best_choice = np.inf, None
    for chunk in _chunks(groups, subsets):
        x = np.concatenate(
            [masks[cap][chunk[:, k]][:, None, :] for k, cap in enumerate(worker_caps)], axis=1
        )  # [B, N, E] 0/1
        r = x.sum(1)
        ok = (r > 0).all(1)
        if want is not None:
            ok &= (r == want[None, :]).all(1)
        if not ok.any():
            continue
        x, r, idx = x[ok], r[ok], np.nonzero(ok)[0]
        if kind == "megascale":
            worst = _min_max_load(x, load)
        else:
            assert coact is not None
            z = x / r[:, None, :]
            pairs = 0.5 * np.einsum("bne,ef,bnf->bn", z, coact, z, optimize=True)
            worst = (pairs + np.einsum("bne,be->bn", x, load[None, :] / (r * r))).max(1)
        b = int(np.argmin(worst))
        if best_choice is None or worst[b] < best_val - 1e-12 * max(1.0, abs(best_val)):
            best_val, best_choice = float(worst[b]), chunk[idx[b]]
    if best_choice is None:
        raise ConfigError("no placement satisfies the constraints")
    # map the enumeration's worker order back onto the real workers (equal capacities are interchangeable)
    pools: dict[int, list[tuple[int, ...]]] = {}
    for k, cap in enumerate(worker_caps):
        pools.setdefault(cap, []).append(subsets[cap][int(best_choice[k])])
    slots = []
    for cap in caps:
        s = pools[cap].pop(0)
        slots.append(tuple(list(s) + [EMPTY] * (cap - len(s))))
    return LayerPlacement(num_experts, tuple(slots))


def _min_max_load(x: np.ndarray, load: np.ndarray) -> np.ndarray:
    """[B]: ``max_S w({i: R_i within S}) / |S|`` over non-empty worker sets S (the optimal shares'
    max load, see :mod:`afdserve.balance.shares`), for placements ``x`` [B, N, E]."""
    n = x.shape[1]
    masks = np.einsum("bne,n->be", x, (1 << np.arange(n)).astype(np.float64)).astype(np.int64)  # R_i as a bit mask
    sets = np.arange(1, 1 << n, dtype=np.int64)
    sizes = np.array([bin(int(s)).count("1") for s in sets], dtype=np.float64)
    inside = (masks[:, :, None] & ~sets[None, None, :]) == 0  # [B, E, S]
    return (np.einsum("bes,e->bs", inside.astype(np.float64), load) / sizes).max(1)


def _chunks(groups: list[tuple[int, int]], subsets: dict[int, list[tuple[int, ...]]]) -> Iterator[np.ndarray]:
    per_group = [itertools.combinations_with_replacement(range(len(subsets[cap])), size) for cap, size in groups]
    it = (tuple(itertools.chain.from_iterable(c)) for c in itertools.product(*[list(g) for g in per_group]))
    while True:
        block = list(itertools.islice(it, _CHUNK))
        if not block:
            return
        yield np.array(block, dtype=np.int64)
