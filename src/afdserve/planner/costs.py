"""The constants of the performance model: what one micro-batch's compute, one message and the
runtime around them cost (seconds, bytes).

* attention: ``Ta = k1 * b_a + k2`` with the KV-cache read making ``k1`` grow with the average
  sequence length ``s``: ``k1(s) = k1_tok + k1_ctx * s`` (:class:`AttentionCost`);
* experts: ``Te = k3 * b_e + k4`` (``b_e`` = token-expert pairs an expert node receives;
  :class:`ExpertCost`);
* the network: a bandwidth-utilisation curve ``Util(message bytes)`` (Eq. 6; :class:`UtilCurve`,
  :class:`NetworkProfile`) and what goes on the wire (:class:`WireFormat`);
* this repository's runtime around the compute (:class:`RuntimeCosts`, the local model only).

A :class:`afdserve.planner.profile.Profile` holds them per GPU and TP size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from afdserve.errors import ConfigError

__all__ = ["AttentionCost", "ExpertCost", "UtilCurve", "NetworkProfile", "WireFormat", "RuntimeCosts"]


@dataclass(frozen=True)
class AttentionCost:
    """``Ta = (k1_tok + k1_ctx * s) * b_a + k2`` seconds for one micro-batch of ``b_a`` tokens."""

    k1_tok: float
    k1_ctx: float
    k2: float
    tp: int = 1
    gpu: str = ""
    n_samples: int = 0
    rmse_s: float | None = None
    seq_len_range: tuple[int, int] | None = None

    def k1(self, seq_len: float) -> float:
        return self.k1_tok + self.k1_ctx * seq_len

    def time(self, b_a: float, seq_len: float) -> float:
        return self.k1(seq_len) * b_a + self.k2


@dataclass(frozen=True)
class ExpertCost:
    """``Te = k3 * b_e + k4`` seconds for an expert node receiving ``b_e`` token-expert pairs."""

    k3: float
    k4: float
    tp: int = 1
    experts_per_node: int = 1
    gpu: str = ""
    n_samples: int = 0
    rmse_s: float | None = None

    def time(self, b_e: float) -> float:
        return self.k3 * b_e + self.k4


@dataclass(frozen=True)
class UtilCurve:
    """Bandwidth utilisation as a function of the per-peer message size (Eq. 6's ``Util``).

    Parametric form ``Util(s) = peak * s / (s + half_bytes)``; this is exactly what a link with a
    fixed per-message latency ``a`` and asymptotic bandwidth ``beta`` delivers, relative to a nominal
    bandwidth ``W``: ``peak = beta / W`` and ``half_bytes = a * beta``.  When ``points`` is given
    (``(size, util)`` pairs), Util is interpolated linearly in log(size) instead, clamped at the ends.
    The default is the ideal curve, Util = 1.
    """

    peak: float = 1.0
    half_bytes: float = 0.0
    points: tuple[tuple[float, float], ...] = ()

    def __call__(self, size_bytes: float) -> float:
        if self.points:
            xs = [math.log(max(p[0], 1.0)) for p in self.points]
            ys = [p[1] for p in self.points]
            return float(np.interp(math.log(max(size_bytes, 1.0)), xs, ys))
        if size_bytes <= 0:
            return self.peak if self.half_bytes == 0 else 0.0
        return self.peak * size_bytes / (size_bytes + self.half_bytes)

    @property
    def is_ideal(self) -> bool:
        return not self.points and self.peak == 1.0 and self.half_bytes == 0.0


@dataclass(frozen=True)
class NetworkProfile:
    """A measured link: ``time(message) = latency_s + bytes / bandwidth_Bps`` per message.

    ``nominal_Bps`` is the bandwidth the link is sold as (``W`` in Eq. 6); when unset the fitted
    asymptotic bandwidth is used, so Util tends to 1 for large messages.
    """

    latency_s: float
    bandwidth_Bps: float
    nominal_Bps: float | None = None
    points: tuple[tuple[float, float], ...] = ()  # optional tabulated (size, util)

    @property
    def nominal(self) -> float:
        return self.nominal_Bps or self.bandwidth_Bps

    def message_time(self, size_bytes: float) -> float:
        return self.latency_s + size_bytes / self.bandwidth_Bps

    def util_curve(self) -> UtilCurve:
        return UtilCurve(
            peak=self.bandwidth_Bps / self.nominal, half_bytes=self.latency_s * self.bandwidth_Bps, points=self.points
        )


@dataclass(frozen=True)
class WireFormat:
    """What the runtime puts on the wire between attention and expert workers.

    ``dispatch``: ``"pairs"`` -- one copy of a token's hidden vector per selected expert (the paper's
    accounting, Eq. 6); ``"routed"`` -- one copy per expert *worker* hosting at least one of the
    token's experts; ``"broadcast"`` -- every token to every expert worker.  Replies carry one
    hidden vector per token sent.  ``meta_bytes_per_token`` covers expert ids / weights.
    """

    act_bytes: float = 2.0
    meta_bytes_per_token: float = 0.0
    dispatch: Literal["pairs", "routed", "broadcast"] = "routed"

    def __post_init__(self) -> None:
        if self.dispatch not in ("pairs", "routed", "broadcast"):
            raise ConfigError(f"wire.dispatch must be pairs|routed|broadcast, got {self.dispatch!r}")


@dataclass(frozen=True)
class RuntimeCosts:
    """What this repository's runtime spends around the model's compute, per event (seconds).

    Only the local model uses these (:func:`afdserve.planner.local.predict_local`); the planner's
    search does not.  ``afdserve profile`` measures them with the real M2N library and pipeline:

    * ``send_s + send_per_byte_s * bytes``: the sender's CPU time in ``Links.send`` (copy into the
      receiver's registered slot, completion); ``ring_s`` more when the receiver sleeps in ``poll``
      (the wake-up byte on the pair's socket);
    * ``take_s``: the receiver's CPU time to take an arrived message (``recv``/``gather`` + release);
    * ``wake_s``: how long a receiver that went to sleep (it waited longer than ``spin_s``, the
      busy-poll time of ``CommConfig``) takes to run again after the message arrives;
    * ``dispatch_per_worker_s``: the attention worker's extra bookkeeping per micro-batch and layer
      for each expert worker beyond the first (the attention entry's ``k1``/``k2`` are measured
      dispatching to one);
    * ``lm_head_s + lm_head_per_token_s * b``: the LM head of a micro-batch of ``b`` sequences, which
      the runtime runs per micro-batch as soon as its last layer is combined (the profile's ``step``
      overhead then excludes it); interpolated between ``lm_head_points`` (measured ``(b, s)``)
      where given, the affine fit outside them;
    * ``corun_attention`` / ``corun_expert``: how much longer an attention / expert worker's work
      takes while a worker of the other role computes on another core (they share the last-level
      cache and the memory bandwidth), measured;
    * ``cores``: CPU cores the worker processes share; with more runnable workers than cores they
      time-share them (0: every worker has its own core or device);
    * ``begin_s + begin_per_token_s * b``: the part of a step's overhead before its first layer
      (``Engine.begin``: scheduling, inputs), which delays the experts' first layer;
    * ``lend_expert_points`` / ``lend_lm_head_points``: measured ``(pairs or b, speed-up)`` of the
      fused MoE / the LM head on every core over one thread: what they gain from the cores that
      waiting workers lend (the cpu backend's ``lend_idle_cores``); interpolated, 1 where empty;
    * ``colocated_k1_tok``, ``colocated_k1_ctx``, ``colocated_k2``: a decode layer of the colocated
      engine outside its experts (``pre_moe`` + ``post_moe``, no dispatch), as ``AttentionCost``.
    """

    cores: int = 0
    send_s: float = 0.0
    send_per_byte_s: float = 0.0
    ring_s: float = 0.0
    take_s: float = 0.0
    wake_s: float = 0.0
    spin_s: float = 50e-6
    dispatch_per_worker_s: float = 0.0
    lm_head_s: float = 0.0
    lm_head_per_token_s: float = 0.0
    lm_head_points: tuple[tuple[float, float], ...] = ()  # measured (b, seconds): interpolated
    corun_attention: float = 1.0
    corun_expert: float = 1.0
    begin_s: float = 0.0
    begin_per_token_s: float = 0.0
    lend_expert_points: tuple[tuple[float, float], ...] = ()
    lend_lm_head_points: tuple[tuple[float, float], ...] = ()
    colocated_k1_tok: float = 0.0
    colocated_k1_ctx: float = 0.0
    colocated_k2: float = 0.0

    def colocated_attention_time(self, b: float, seq_len: float) -> float:
        return (self.colocated_k1_tok + self.colocated_k1_ctx * seq_len) * b + self.colocated_k2

    def begin_time(self, b: float) -> float:
        return self.begin_s + self.begin_per_token_s * b

    def lend_expert_speedup(self, pairs: float) -> float:
        return _interp(self.lend_expert_points, pairs)

    def lend_lm_head_speedup(self, b: float) -> float:
        return _interp(self.lend_lm_head_points, b)

    def lm_head_time(self, b: float) -> float:
        if len(self.lm_head_points) >= 2:  # piecewise linear between the measured points
            xs = [p[0] for p in self.lm_head_points]
            ys = [p[1] for p in self.lm_head_points]
            if xs[0] <= b <= xs[-1]:
                return float(np.interp(b, xs, ys))
        return self.lm_head_s + self.lm_head_per_token_s * b

    def send_time(self, nbytes: float, receiver_asleep: bool = False) -> float:
        return self.send_s + self.send_per_byte_s * nbytes + (self.ring_s if receiver_asleep else 0.0)


def _interp(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise linear through ``points`` (clamped at the ends); 1.0 without points."""
    if not points:
        return 1.0
    return float(np.interp(x, [p[0] for p in points], [p[1] for p in points]))


def interp_extend(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise linear through the measured ``points`` (x ascending, at least two), extended beyond
    them along the first / last segment (never below 0)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if xs[0] <= x <= xs[-1]:
        return float(np.interp(x, xs, ys))
    i = 0 if x < xs[0] else len(xs) - 2
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return max(0.0, ys[i] + slope * (x - xs[i]))
