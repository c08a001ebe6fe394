"""Placement planners: pure functions from a load snapshot and a slot budget to a :class:`Placement`.

Both planners work layer by layer in three steps:

1. **Replica counts** (:func:`replica_counts`): every expert starts with one replica; the next free
   slot goes to the expert with the largest per-replica load ``load_i / r_i`` (ties: fewer replicas,
   then lower id) until all ``sum(capacities)`` slots are used, an expert never having more replicas
   than workers and the counts always fitting the per-worker capacities. The load is
   ``max(a_i, K)`` for MegaScale-Infer and the activation count ``c_i`` for JANUS.
2. **Greedy assignment**: replicas, heaviest first, each go to the worker (with a free slot and no
   copy of that expert) whose cost after adding it is smallest — for MegaScale-Infer the classic
   longest-processing-time rule on ``max(a_i, K) / r_i``, for JANUS the worker whose co-activation
   load ``I(g)`` grows the least (ties: lower resulting ``I(g)``, lower token load, fewer used
   slots, lower id).
3. **Local search**: moves and swaps of single replicas off the most expensive worker while they
   lower its cost without making the other worker as expensive.
4. MegaScale-Infer only: the token shares ``x_ig`` that minimise the max load for that placement
   (:func:`~afdserve.balance.shares.optimal_shares`; steps 2-3 score with the even split
   ``1 / r_i``), stored in ``LayerPlacement.shares`` for the ``"shares"`` routing policy.

The result is then compared with :func:`round_robin_layer` under the same objective and the
cheaper one is returned, so a plan is never worse than the static baseline. Everything is
deterministic: equal inputs give the same placement in every process.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Sequence

import numpy as np

from afdserve.balance.load import LoadSnapshot
from afdserve.balance.objective import Kind, cost_model, layer_load, worker_costs
from afdserve.balance.placement import EMPTY, LayerPlacement, Placement, capacities_of, round_robin_layer
from afdserve.balance.shares import optimal_shares
from afdserve.errors import ConfigError

_REL_TOL = 1e-9


def replica_counts(load: np.ndarray, capacities: Sequence[int]) -> np.ndarray:
    """int64 [E]: replicas per expert, handed out one slot at a time to the largest ``load_i / r_i``."""
    load = np.asarray(load, dtype=np.float64)
    caps = [int(c) for c in capacities]
    num_experts, num_workers, total = len(load), len(caps), sum(caps)
    if total < num_experts:
        raise ConfigError(f"{num_experts} experts do not fit in {total} slots ({caps})")
    r = np.ones(num_experts, dtype=np.int64)
    uniform = len(set(caps)) == 1
    # most replicas the k experts with most replicas can have together (max-flow/min-cut bound)
    cap_k = np.array([sum(min(c, k) for c in caps) for k in range(num_experts + 1)], dtype=np.int64)
    heap = [(-float(load[i]), 1, i) for i in range(num_experts)]
    heapq.heapify(heap)
    left = total - num_experts
    while left > 0 and heap:
        _, ri, i = heapq.heappop(heap)
        if ri >= num_workers:
            continue
        r[i] += 1
        if not uniform and not _fits(r, cap_k):
            r[i] -= 1
            continue  # more replicas of i can never fit again: r only grows
        left -= 1
        heapq.heappush(heap, (-float(load[i]) / float(r[i]), int(r[i]), i))
    return r


def _fits(r: np.ndarray, cap_k: np.ndarray) -> bool:
    top = np.cumsum(np.sort(r)[::-1])
    return bool(np.all(top <= cap_k[1 : len(r) + 1]))


def plan_megascale(
    snapshot: LoadSnapshot, num_workers: int, slots_per_worker: int | Sequence[int], *, cold_cost: float = 0.0
) -> Placement:
    """MegaScale-Infer's redundancy plan: minimise ``max_g sum_i x_ig * max(a_i, K)`` per layer.

    ``cold_cost`` is ``K`` in tokens per step (the load below which an expert costs the same as an
    idle one, e.g. the roofline ridge point); ``slots_per_worker`` is an int or one int per worker
    (per-worker memory, see :func:`~afdserve.balance.placement.slots_from_memory`).
    """
    return _plan(snapshot, num_workers, slots_per_worker, "megascale", cold_cost)


def plan_janus(snapshot: LoadSnapshot, num_workers: int, slots_per_worker: int | Sequence[int]) -> Placement:
    """JANUS: replicas by ``c_i / r_i``, then co-activation-aware placement (min max ``I(g)``).

    Needs a snapshot with co-activation counts.
    """
    return _plan(snapshot, num_workers, slots_per_worker, "janus", 0.0)


def _plan(snapshot: LoadSnapshot, num_workers: int, slots_per_worker: int | Sequence[int], kind: Kind, cold_cost: float) -> Placement:
    caps = capacities_of(num_workers, slots_per_worker)
    layers = []
    for layer in range(snapshot.num_layers):
        load, coact = layer_load(snapshot, layer, kind, cold_cost)
        layers.append(plan_layer(load, coact, kind, caps)[0])
    return Placement(tuple(layers))


def plan_layer(
    load: np.ndarray, coact: np.ndarray | None, kind: Kind, capacities: Sequence[int], *, guard: bool = True
) -> tuple[LayerPlacement, bool]:
    """Plans one layer; returns (placement, whether the round-robin guard replaced the plan)."""
    caps = tuple(int(c) for c in capacities)
    num_experts = len(load)
    r = replica_counts(load, caps)
    unary, pair = cost_model(load, coact, r, kind)
    per_replica = np.asarray(load, dtype=np.float64) / r
    members = _greedy(r, unary, pair, per_replica, caps)
    members = _local_search(members, unary, pair, caps, num_experts)
    slots = tuple(tuple(m + [EMPTY] * (c - len(m))) for m, c in zip(members, caps))
    lp = LayerPlacement(num_experts, slots)
    if kind == "megascale":  # the best token shares x_ig for this placement
        _, shares = optimal_shares([lp.replicas_of(e) for e in range(num_experts)], load, len(caps))
        lp = LayerPlacement(num_experts, slots, tuple(tuple(0.0 if e == EMPTY else shares[e][g] for e in row) for g, row in enumerate(slots)))
    if not guard:
        return lp, False
    rr = round_robin_layer(num_experts, len(caps), caps)
    planned = worker_costs(lp, load, coact, kind).max()
    baseline = worker_costs(rr, load, coact, kind).max()
    if baseline < planned:
        return rr, True
    return lp, False


def _lexmin(candidates: np.ndarray, keys: list[np.ndarray]) -> int:
    """Index in ``candidates`` minimising ``keys`` lexicographically, float keys equal within a tolerance."""
    idx = candidates
    for key in keys:
        vals = key[idx]
        best = vals.min()
        tol = _REL_TOL * max(1.0, abs(float(best)))
        idx = idx[vals <= best + tol]
        if idx.size == 1:
            break
    return int(idx[0])


def _greedy(
    r: np.ndarray, unary: np.ndarray, pair: np.ndarray | None, per_replica: np.ndarray, caps: tuple[int, ...]
) -> list[list[int]]:
    num_experts, num_workers = len(r), len(caps)
    mass = unary + (pair.sum(1) if pair is not None else 0.0)
    order = sorted(range(num_experts), key=lambda i: (-float(mass[i]), -float(per_replica[i]), i))
    members: list[list[int]] = [[] for _ in range(num_workers)]
    on = np.zeros((num_workers, num_experts), dtype=bool)
    cost = np.zeros(num_workers)
    token_load = np.zeros(num_workers)
    pair_sum = np.zeros((num_workers, num_experts))  # pair_sum[g, i] = sum_{j on g} pair[j, i]
    cap = np.array(caps)
    used = np.zeros(num_workers, dtype=np.int64)
    workers = np.arange(num_workers)
    for i in order:
        for _ in range(int(r[i])):
            ok = workers[(used < cap) & ~on[:, i]]
            if ok.size == 0:
                _augment(i, members, on, used, cap)  # frees a slot on some worker without i
                cost, token_load, pair_sum = _recompute(members, unary, pair, per_replica, num_experts)
                ok = workers[(used < cap) & ~on[:, i]]
            delta = unary[i] + pair_sum[:, i]
            if pair is not None:  # JANUS: smallest added co-activation, then smallest resulting I(g)
                keys = [delta, cost + delta, token_load, used.astype(np.float64)]
            else:  # MegaScale: smallest resulting load (LPT)
                keys = [cost + delta, used.astype(np.float64)]
            g = _lexmin(ok, keys)
            members[g].append(i)
            on[g, i] = True
            used[g] += 1
            cost[g] += float(delta[g])
            token_load[g] += per_replica[i]
            if pair is not None:
                pair_sum[g] += pair[i]
    return members


def _recompute(
    members: list[list[int]], unary: np.ndarray, pair: np.ndarray | None, per_replica: np.ndarray, num_experts: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = len(members)
    cost, token_load, pair_sum = np.zeros(n), np.zeros(n), np.zeros((n, num_experts))
    for g, m in enumerate(members):
        if not m:
            continue
        idx = np.array(m)
        cost[g] = unary[idx].sum() + (pair[np.ix_(idx, idx)].sum() / 2.0 if pair is not None else 0.0)
        token_load[g] = per_replica[idx].sum()
        if pair is not None:
            pair_sum[g] = pair[idx].sum(0)
    return cost, token_load, pair_sum


def _augment(i: int, members: list[list[int]], on: np.ndarray, used: np.ndarray, cap: np.ndarray) -> None:
    """Makes room for one more replica of ``i`` by shifting replicas along an augmenting path.

    Every worker without ``i`` is full; find workers u0 -> u1 -> ... -> um (um has a free slot) where
    some expert j_k on u_{k-1} can move to u_k (which does not hold j_k). Shift them all, freeing a
    slot on u0. Such a path exists whenever the replica counts fit (Ford-Fulkerson).
    """
    num_workers = len(members)
    starts = [u for u in range(num_workers) if not on[u, i]]
    parent: dict[int, tuple[int, int] | None] = {u: None for u in starts}
    queue = deque(starts)
    end = -1
    while queue and end < 0:
        u = queue.popleft()
        for j in members[u]:
            for v in range(num_workers):
                if v in parent or on[v, j]:
                    continue
                parent[v] = (u, j)
                if used[v] < cap[v]:
                    end = v
                    break
                queue.append(v)
            if end >= 0:
                break
    if end < 0:
        raise ConfigError(f"the replica counts do not fit the slots (no room for expert {i})")
    v = end
    while parent[v] is not None:
        u, j = parent[v]  # type: ignore[misc]
        members[u].remove(j)
        on[u, j] = False
        members[v].append(j)
        on[v, j] = True
        used[v] += 1
        used[u] -= 1
        v = u


def _local_search(
    members: list[list[int]], unary: np.ndarray, pair: np.ndarray | None, caps: tuple[int, ...], num_experts: int,
    max_rounds: int | None = None,
) -> list[list[int]]:
    """Moves/swaps single replicas off the most expensive worker while that lowers the max cost."""
    n = len(members)
    if n < 2:
        return members
    members = [list(m) for m in members]
    per_replica = np.zeros(num_experts)
    cost, _, pair_sum = _recompute(members, unary, pair, per_replica, num_experts)
    on = np.zeros((n, num_experts), dtype=bool)
    for g, m in enumerate(members):
        on[g, m] = True
    cap = np.array(caps)
    cmax = max(caps)
    rounds = max_rounds if max_rounds is not None else 4 * sum(caps) + 16
    for _ in range(rounds):
        p = int(np.argmax(cost))
        target = cost[p] - _REL_TOL * max(1.0, abs(float(cost[p])))
        # slot matrix [n, cmax] of experts (-1 = none)
        mat = np.full((n, cmax), -1, dtype=np.int64)
        for g, m in enumerate(members):
            mat[g, : len(m)] = m
        valid_b = mat >= 0
        b_idx = np.where(valid_b, mat, 0)
        u_b = np.where(valid_b, unary[b_idx], 0.0)
        s_qb = pair_sum[np.arange(n)[:, None], b_idx] if pair is not None else 0.0
        s_pb = pair_sum[p][b_idx] if pair is not None else 0.0
        b_on_p = on[p][b_idx]
        best = (np.inf, None)
        for a in members[p]:
            s_pa = pair_sum[p, a] if pair is not None else 0.0
            p_without_a = cost[p] - unary[a] - s_pa
            has_a = on[:, a]
            s_qa = pair_sum[:, a] if pair is not None else np.zeros(n)
            # move a -> q
            move_q = cost + unary[a] + s_qa
            move_ok = (np.arange(n) != p) & ~has_a & (np.array([len(m) for m in members]) < cap)
            worst = np.where(move_ok, np.maximum(move_q, p_without_a), np.inf)
            q = int(np.argmin(worst))
            if worst[q] < best[0]:
                best = (float(worst[q]), ("move", a, q, -1))
            # swap a (on p) with b (on q)
            v_ab = pair[a][b_idx] if pair is not None else 0.0
            new_p = p_without_a + u_b + s_pb - v_ab
            new_q = cost[:, None] - u_b - s_qb + unary[a] + s_qa[:, None] - v_ab
            swap_ok = valid_b & ~has_a[:, None] & ~b_on_p & (np.arange(n) != p)[:, None]
            worst = np.where(swap_ok, np.maximum(new_p, new_q), np.inf)
            flat = int(np.argmin(worst))
            qq, s = divmod(flat, cmax)
            if worst[qq, s] < best[0]:
                best = (float(worst[qq, s]), ("swap", a, qq, int(mat[qq, s])))
        if best[1] is None or best[0] >= target:
            break
        _, a, q, b = best[1]
        members[p].remove(a)
        members[q].append(a)
        on[p, a], on[q, a] = False, True
        if b >= 0:
            members[q].remove(b)
            members[p].append(b)
            on[q, b], on[p, b] = False, True
        cost, _, pair_sum = _recompute(members, unary, pair, per_replica, num_experts)
    return members
