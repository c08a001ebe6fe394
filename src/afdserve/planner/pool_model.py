"""The autoscaling policy's model of a *local* deployment (``autoscale.PoolModel``) from a measured
profile: :func:`afdserve.planner.local.predict_local` at every pool size the policy asks about.

``tpot(n_a, n_e, demand)`` finds the batch per attention worker ``b`` at which ``n_a`` attention
workers produce ``demand`` decode tokens per second (``n_a * b / T(b) = demand``; the rate grows with
``b``), and returns that step time; ``capacity(n_a, n_e)`` is the largest rate whose step time meets
the TPOT SLO.  Predictions are cached per ``(n_a, n_e, b)``."""

from __future__ import annotations

import math

from afdserve.planner.local import predict_local
from afdserve.planner.profile import Profile
from afdserve.planner.spec import ModelSpec

__all__ = ["LocalPoolModel"]


class LocalPoolModel:
    def __init__(self, profile: Profile, spec: ModelSpec, micro_batches: int, max_batch: int, seq_len: float,
                 slo_tpot_s: float):
        if profile.runtime is None:
            raise ValueError("the autoscaler's model needs a profile measured by afdserve profile (runtime costs)")
        if min(micro_batches, max_batch) < 1 or not (seq_len > 0 and slo_tpot_s > 0):
            raise ValueError("micro_batches, max_batch, seq_len and slo_tpot_s must be positive")
        self.profile, self.spec, self.m, self.max_batch = profile, spec, micro_batches, max_batch
        self.seq_len, self.slo = seq_len, slo_tpot_s
        self._cache: dict[tuple[int, int, int], float] = {}

    def step(self, n_a: int, n_e: int, b: int) -> float:
        """Predicted decode step (s) with ``b`` sequences on each of ``n_a`` attention workers."""
        key = (n_a, n_e, b)
        if key not in self._cache:
            self._cache[key] = predict_local(self.profile, n_a, n_e, min(self.m, b), b, self.seq_len,
                                             self.spec).iteration_s
        return self._cache[key]

    def _rate(self, n_a: int, n_e: int, b: int) -> float:
        return n_a * b / self.step(n_a, n_e, b)

    def tpot(self, n_a: int, n_e: int, demand_tok_s: float) -> float:
        if self._rate(n_a, n_e, self.max_batch) < demand_tok_s:
            return math.inf
        lo, hi = 1, self.max_batch  # the least b whose rate reaches the demand
        while lo < hi:
            mid = (lo + hi) // 2
            if self._rate(n_a, n_e, mid) >= demand_tok_s:
                hi = mid
            else:
                lo = mid + 1
        return self.step(n_a, n_e, lo)

    def capacity(self, n_a: int, n_e: int) -> float:
        if self.step(n_a, n_e, 1) > self.slo:
            return 0.0
        lo, hi = 1, self.max_batch  # the largest b whose step meets the SLO
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.step(n_a, n_e, mid) <= self.slo:
                lo = mid
            else:
                hi = mid - 1
        return self._rate(n_a, n_e, lo)
