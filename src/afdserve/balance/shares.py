"""Optimal token shares of replicated experts: ``min_x max_g sum_i x_ig * w_i``.

Given where the replicas are (expert ``i`` on workers ``R_i``) and per-expert costs ``w_i``, the
fractions ``x_ig`` (``sum_g x_ig = 1``, ``x_ig > 0`` only for ``g`` in ``R_i``) that minimise the
most loaded worker form a divisible load-balancing problem. Its optimum is

    T* = max over worker sets S of  w({i : R_i within S}) / |S|

(the experts whose replicas all lie in ``S`` must be served by ``S``; Hall's theorem for flows
makes the bound tight). :func:`optimal_shares` finds the maximising set by Dinkelbach iteration
over max-flow min-cuts (at most N max-flows, usually one or two) and returns the shares of the
final flow.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np

_EPS = 1e-9


def optimal_shares(replicas: Sequence[Sequence[int]], cost: np.ndarray, num_workers: int) -> tuple[float, list[dict[int, float]]]:
    """(T*, shares): ``shares[i][g]`` = fraction of expert ``i``'s tokens served by worker ``g``."""
    w = np.asarray(cost, dtype=np.float64)
    total = float(w.sum())
    even = [{g: 1.0 / len(r) for g in r} for r in replicas]
    if total <= 0.0:
        return 0.0, even
    t = max(total / num_workers, max(float(w[i]) / len(r) for i, r in enumerate(replicas)))
    for _ in range(num_workers + 2):
        flow, edge_flow, reach = _max_flow(replicas, w, num_workers, t)
        if flow >= total - _EPS * max(1.0, total):
            break
        workers = {g for g in range(num_workers) if reach[len(replicas) + g]}
        inside = sum(float(w[i]) for i, r in enumerate(replicas) if all(g in workers for g in r))
        t_next = inside / max(len(workers), 1)
        if t_next <= t * (1 + 1e-12):  # float noise: accept the current t
            break
        t = t_next
    shares: list[dict[int, float]] = []
    for i, r in enumerate(replicas):
        if w[i] > 0:
            f = {g: edge_flow[i].get(g, 0.0) / float(w[i]) for g in r}
            s = sum(f.values())
            shares.append({g: v / s for g, v in f.items()} if s > 0 else even[i])
        else:
            shares.append(even[i])
    return t, shares


def _max_flow(
    replicas: Sequence[Sequence[int]], w: np.ndarray, num_workers: int, t: float
) -> tuple[float, list[dict[int, float]], list[bool]]:
    """Dinic on source -> expert (w_i) -> worker (inf) -> sink (t). Returns the flow value, the
    expert->worker flows and which nodes the source reaches in the final residual graph."""
    e = len(replicas)
    n_nodes = e + num_workers + 2
    src, snk = e + num_workers, e + num_workers + 1
    to: list[int] = []
    cap: list[float] = []
    adj: list[list[int]] = [[] for _ in range(n_nodes)]

    def add(u: int, v: int, c: float) -> int:
        adj[u].append(len(to))
        to.append(v)
        cap.append(c)
        adj[v].append(len(to))
        to.append(u)
        cap.append(0.0)
        return len(to) - 2

    big = float(w.sum()) + 1.0
    edge_ids: list[dict[int, int]] = []
    for i, r in enumerate(replicas):
        add(src, i, float(w[i]))
        edge_ids.append({g: add(i, e + g, big) for g in r})
    for g in range(num_workers):
        add(e + g, snk, t)
    tol = _EPS * max(1.0, big)
    flow = 0.0
    while True:
        level = [-1] * n_nodes
        level[src] = 0
        q = deque([src])
        while q:
            u = q.popleft()
            for k in adj[u]:
                if cap[k] > tol and level[to[k]] < 0:
                    level[to[k]] = level[u] + 1
                    q.append(to[k])
        if level[snk] < 0:
            break
        it = [0] * n_nodes

        def push(u: int, f: float) -> float:
            if u == snk:
                return f
            while it[u] < len(adj[u]):
                k = adj[u][it[u]]
                v = to[k]
                if cap[k] > tol and level[v] == level[u] + 1:
                    got = push(v, min(f, cap[k]))
                    if got > 0:
                        cap[k] -= got
                        cap[k ^ 1] += got
                        return got
                it[u] += 1
            return 0.0

        while True:
            f = push(src, float("inf"))
            if f <= 0:
                break
            flow += f
    reach = [lv >= 0 for lv in level]
    edge_flow = [{g: cap[k ^ 1] for g, k in ids.items()} for ids in edge_ids]
    return flow, edge_flow, reach
