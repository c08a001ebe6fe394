"""The performance model of disaggregated expert parallelism (MegaScale-Infer §4.1-4.2).

Plain functions, one per equation, in SI units (seconds, bytes, bytes/s):

* token conservation  ``b_a * m * n_a = b_e * m * n_e / K = B``   (:func:`expert_micro_batch`)
* balance rule        ``n_a = k1 * n_e / (k3 * K)``                 (:func:`balance_n_a`, constraint 1)
* communication       Eq. (6)                                       (:func:`comm_time`)
* pipeline conditions Eqs. (1)-(3)                                  (:func:`check_pipeline`)
* iteration latency   Eqs. (4), (5)                                 (:func:`iteration_bounds`, :func:`eq5_total`)
* SLO                 Eq. (7)                                       (:func:`meets_slo`)
* KV memory           Eq. (8)                                       (:func:`attention_memory_bytes`)
* cost metrics        throughput per GPU / cost / watt             (:func:`efficiency`)

``n_e`` is the number of expert nodes; in the paper every node holds one expert (``n_e = E``), we
also allow ``experts_per_node > 1`` (``n_e = E / experts_per_node``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from afdserve.planner.costs import UtilCurve
from afdserve.planner.spec import ModelSpec

__all__ = [
    "expert_micro_batch",
    "global_batch",
    "balance_n_a",
    "a2e_bytes_per_gpu",
    "expert_recv_bytes_per_gpu",
    "a2e_bytes_per_pair",
    "comm_time",
    "PipelineCheck",
    "check_pipeline",
    "min_micro_batches",
    "iteration_bounds",
    "eq5_total",
    "iteration_time",
    "meets_slo",
    "kv_cache_bytes",
    "attention_memory_bytes",
    "attention_memory_ok",
    "max_b_a_for_memory",
    "Efficiency",
    "efficiency",
]


# ----- token bookkeeping ---------------------------------------------------------------------
def expert_micro_batch(b_a: float, n_a: int, top_k: int, n_e: int) -> float:
    """``b_e``: token-expert pairs one expert node gets per micro-batch (uniform routing)."""
    return b_a * n_a * top_k / n_e


def global_batch(b_a: float, m: int, n_a: int) -> float:
    """``B = b_a * m * n_a``."""
    return b_a * m * n_a


def balance_n_a(k1: float, k3: float, n_e: int, top_k: int) -> float:
    """Attention nodes that balance ``Ta`` and ``Te`` (constraint 1), ignoring ``k2``/``k4``.

    From ``k1 * b_a = k3 * b_e`` with ``b_e = b_a * n_a * K / n_e``: ``n_a = k1 * n_e / (k3 * K)``
    (the paper's ``k1 * E / (k3 * K)`` with one expert per node).
    """
    return k1 * n_e / (k3 * top_k)


# ----- communication (Eq. 6) -----------------------------------------------------------------
def a2e_bytes_per_gpu(b_a: float, hidden: int, top_k: int, tp_a: int, act_bytes: float = 2.0) -> float:
    """Bytes one attention GPU sends per micro-batch: ``b_a * h * K / tp_a`` elements."""
    return b_a * hidden * top_k * act_bytes / tp_a


def expert_recv_bytes_per_gpu(b_e: float, hidden: int, tp_e: int, act_bytes: float = 2.0) -> float:
    """Bytes one expert GPU receives per micro-batch: ``b_e * h / tp_e`` elements."""
    return b_e * hidden * act_bytes / tp_e


def a2e_bytes_per_pair(
    b_a: float, hidden: int, top_k: int, n_e: int, tp_a: int, tp_e: int = 1, act_bytes: float = 2.0
) -> float:
    """Bytes one attention GPU sends to *each* expert GPU (paper §7.3: ``b_a*K/E*h*2/tp_a``)."""
    return a2e_bytes_per_gpu(b_a, hidden, top_k, tp_a, act_bytes) / (n_e * tp_e)


def comm_time(
    send_bytes: float,
    send_peers: int,
    w_a: float,
    recv_bytes: float,
    recv_peers: int,
    w_e: float,
    util: UtilCurve | None = None,
    util_e: UtilCurve | None = None,
) -> float:
    """Eq. (6): ``Tc = max(send / (W_a*Util), recv / (W_e*Util))``.

    ``send_bytes`` leave one attention GPU towards ``send_peers`` expert GPUs; ``recv_bytes``
    reach one expert GPU from ``recv_peers`` attention GPUs.  ``Util`` is evaluated at the
    per-peer message size (the size the M2N benchmark of §7.3 varies); with the ideal curve the
    two readings of Eq. (6) agree.  ``util_e`` is the receiving side's curve (default: ``util``).
    """
    ua = util or UtilCurve()
    ue = util_e or ua

    def side(total: float, peers: int, w: float, u: UtilCurve) -> float:
        if total <= 0:
            return 0.0
        return total / (w * u(total / max(peers, 1)))

    return max(side(send_bytes, send_peers, w_a, ua), side(recv_bytes, recv_peers, w_e, ue))


# ----- pipeline (Eqs. 1-5) -------------------------------------------------------------------
@dataclass(frozen=True)
class PipelineCheck:
    """Which of constraints (1)-(3) hold for ``Ta, Te, Tc, m``."""

    balance_ratio: float  # Ta / Te
    balanced: bool  # (1) Ta ~ Te within the tolerance
    comm_hidden: bool  # (2) Tc < Tf
    pipeline_full: bool  # (3) m*Tf >= 2*(Tf + Tc)
    min_micro_batches: int  # smallest m satisfying (3)


def min_micro_batches(tc: float, tf: float) -> int:
    """Smallest ``m`` with ``m*Tf >= 2*(Tf + Tc)``, i.e. ``ceil(2*(1 + Tc/Tf))``."""
    return max(1, math.ceil(2.0 * (1.0 + tc / tf) - 1e-12))


def check_pipeline(ta: float, te: float, tc: float, m: int, balance_tol: float = 0.2) -> PipelineCheck:
    tf = max(ta, te)
    ratio = ta / te if te > 0 else math.inf
    return PipelineCheck(
        balance_ratio=ratio,
        balanced=abs(ratio - 1.0) <= balance_tol,
        comm_hidden=tc < tf,
        pipeline_full=m * tf >= 2.0 * (tf + tc) - 1e-12 * tf,
        min_micro_batches=min_micro_batches(tc, tf),
    )


def iteration_bounds(ta: float, te: float, tc: float, m: int, num_layers: int) -> tuple[float, float]:
    """Eq. (4): bounds on one micro-batch's iteration latency ``T_iter``."""
    tf = max(ta, te)
    return (ta + te + 2 * tc) + m * tf * (num_layers - 1), m * tf * num_layers


def eq5_total(ta: float, te: float, tc: float, m: int, num_layers: int) -> float:
    """Eq. (5): ``T_total = (Ta + Te + 2Tc) + Tf*(m*L - 1)`` -- valid when (3) holds."""
    return (ta + te + 2 * tc) + max(ta, te) * (m * num_layers - 1)


def iteration_time(ta: float, te: float, tc: float, m: int, num_layers: int, tc_back: float | None = None) -> float:
    """Decoding iteration time of the global batch, for any ``m``.

    One micro-batch's round trip through a layer is ``C = Ta + Te + Tc_a2e + Tc_e2a``; the busier
    side needs ``m*Tf`` per layer.  A layer therefore takes ``max(m*Tf, C)`` in steady state and

        T = C + (L - 1) * max(m*Tf, C) + (m - 1) * Tf.

    When constraint (3) holds (``m*Tf >= C``) this is exactly Eq. (5); otherwise the pipeline is
    latency-bound (e.g. ``m = 1`` gives ``L*C``).  The simulator reproduces it.
    ``tc_back`` is the E2A time when it differs from A2E (default: the same, as in the paper).
    """
    tb = tc if tc_back is None else tc_back
    tf = max(ta, te)
    cycle = ta + te + tc + tb
    return cycle + (num_layers - 1) * max(m * tf, cycle) + (m - 1) * tf


def meets_slo(t_iter: float, slo_s: float) -> bool:
    """Eq. (7): the time between tokens must not exceed the SLO."""
    return t_iter <= slo_s


# ----- memory (Eq. 8) ------------------------------------------------------------------------
def kv_cache_bytes(spec: ModelSpec, m: int, b_a: float, seq_len: float, tp_a: int = 1) -> float:
    """KV cache of one attention node: ``m*b_a*s*L`` tokens-layers (``4*m*b_a*s*h*L/g`` bytes
    for bf16 GQA with ``h = heads*head_dim``), times the replication TP forces (see ModelSpec)."""
    return m * b_a * seq_len * spec.num_layers * spec.kv_bytes_per_token_layer * spec.kv_replication(tp_a)


def attention_memory_bytes(spec: ModelSpec, m: int, b_a: float, seq_len: float, tp_a: int = 1) -> float:
    """Left side of Eq. (8): KV cache + attention-side weights of one attention node."""
    return kv_cache_bytes(spec, m, b_a, seq_len, tp_a) + spec.attention_param_bytes * 1.0


def attention_memory_ok(spec: ModelSpec, m: int, b_a: float, seq_len: float, tp_a: int, capacity_bytes: float) -> bool:
    """Eq. (8): ``KV + P_a bytes < tp_a * C_a``."""
    return attention_memory_bytes(spec, m, b_a, seq_len, tp_a) < tp_a * capacity_bytes


def max_b_a_for_memory(spec: ModelSpec, m: int, seq_len: float, tp_a: int, capacity_bytes: float) -> int:
    """Largest integer ``b_a`` satisfying Eq. (8) (0 if even the weights do not fit)."""
    free = tp_a * capacity_bytes - spec.attention_param_bytes
    per = kv_cache_bytes(spec, m, 1, seq_len, tp_a)
    if free <= 0 or per <= 0:
        return 0
    b = int(free // per)
    while b > 0 and not attention_memory_ok(spec, m, b, seq_len, tp_a, capacity_bytes):
        b -= 1
    return b


# ----- objective -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Efficiency:
    throughput_tok_s: float
    num_gpus: int
    cost: float | None
    power_w: float
    throughput_per_gpu: float
    throughput_per_cost: float | None
    throughput_per_watt: float


def efficiency(
    batch: float,
    t_total: float,
    tp_a: int,
    n_a: int,
    tp_e: int,
    n_e: int,
    price_a: float | None,
    price_e: float | None,
    power_a: float,
    power_e: float,
) -> Efficiency:
    """Throughput ``B / T_total`` and its ratios; per cost is ``(B/T)/(tp_a*n_a*Cost_a + tp_e*n_e*Cost_e)``."""
    thr = batch / t_total
    gpus = tp_a * n_a + tp_e * n_e
    cost = None if price_a is None or price_e is None else tp_a * n_a * price_a + tp_e * n_e * price_e
    power = tp_a * n_a * power_a + tp_e * n_e * power_e
    return Efficiency(
        throughput_tok_s=thr,
        num_gpus=gpus,
        cost=cost,
        power_w=power,
        throughput_per_gpu=thr / gpus,
        throughput_per_cost=None if cost is None else thr / cost,
        throughput_per_watt=thr / power,
    )
