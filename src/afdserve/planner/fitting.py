"""Fitting measurements into the constants of a profile: non-negative least squares.

:func:`fit` turns raw measurements of k1..k4 and of the network into a
:class:`~afdserve.planner.profile.Profile`; :func:`fit_runtime` the samples of the M2N transport
(:class:`TransportSamples`, as ``afdserve profile`` measures them) into the runtime's costs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from afdserve.planner.costs import AttentionCost, ExpertCost, NetworkProfile, RuntimeCosts, WireFormat
from afdserve.planner.profile import Profile

__all__ = ["fit_affine", "fit_attention", "fit_expert", "fit_network", "fit", "TransportSamples", "fit_runtime",
           "fit_nondecreasing"]


def _nonneg_lstsq(a: np.ndarray, y: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """Least squares with non-negative coefficients, for the handful of columns we have.

    Solves the unconstrained problem on every subset of columns and keeps the best feasible one
    (exact NNLS for <= 4 columns, which is all we need).
    """
    n = a.shape[1]
    if w is not None:
        a = a * w[:, None]
        y = y * w
    best: tuple[float, np.ndarray] | None = None
    for r in range(n, 0, -1):
        for cols in itertools.combinations(range(n), r):
            sub = a[:, cols]
            if np.linalg.matrix_rank(sub) < len(cols):
                continue
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            res = float(np.sum((sub @ coef - y) ** 2))
            if best is None or res < best[0] - 1e-30:
                full = np.zeros(n)
                full[list(cols)] = coef
                best = (res, full)
    if best is None:
        return np.zeros(n)
    return best[1]


def _rmse(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.sqrt(np.mean((pred - y) ** 2)))


def fit_affine(
    columns: Sequence[Sequence[float]], y: Sequence[float], *, relative: bool = False
) -> tuple[list[float], float]:
    """Non-negative least squares ``y ~ sum_i c_i * columns[i]``; returns ``(coefficients, rmse)``.

    ``relative``: minimise relative errors (weights ``1/y``), so small and large values count alike.
    """
    a = np.column_stack([np.asarray(c, dtype=float) for c in columns])
    yy = np.asarray(y, dtype=float)
    if a.shape[0] < a.shape[1]:
        raise ValueError(f"fit_affine: {a.shape[0]} samples for {a.shape[1]} coefficients")
    w = 1.0 / np.maximum(yy, 1e-12) if relative else None
    coef = _nonneg_lstsq(a, yy, w)
    return [float(c) for c in coef], _rmse(a @ coef, yy)


def fit_attention(
    samples: Sequence[Sequence[float]], *, tp: int = 1, gpu: str = "", relative: bool = False
) -> AttentionCost:
    """Fit ``Ta = (k1_tok + k1_ctx*s) * b + k2`` to ``(batch, seq_len, seconds)`` samples.

    With a single sequence length the ``s`` term cannot be separated: ``k1_ctx`` is then 0 and
    ``k1_tok`` is the slope at that length (``seq_len_range`` records where the fit is valid).
    ``relative``: minimise relative errors (weights ``1/t``) instead of absolute ones.
    """
    arr = np.asarray(samples, dtype=float)
    if arr.ndim != 2 or arr.shape[1] != 3 or len(arr) < 2:
        raise ValueError("fit_attention needs at least 2 (batch, seq_len, seconds) samples")
    b, s, t = arr[:, 0], arr[:, 1], arr[:, 2]
    if np.ptp(b) == 0:
        raise ValueError("fit_attention needs at least two different batch sizes")
    w = 1.0 / np.maximum(t, 1e-12) if relative else None
    if np.ptp(s) > 0:
        coef = _nonneg_lstsq(np.column_stack([b, b * s, np.ones_like(b)]), t, w)
        k1_tok, k1_ctx, k2 = coef
    else:
        k1_tok, k2 = _nonneg_lstsq(np.column_stack([b, np.ones_like(b)]), t, w)
        k1_ctx = 0.0
    pred = (k1_tok + k1_ctx * s) * b + k2
    return AttentionCost(
        k1_tok=float(k1_tok),
        k1_ctx=float(k1_ctx),
        k2=float(k2),
        tp=tp,
        gpu=gpu,
        n_samples=len(arr),
        rmse_s=_rmse(pred, t),
        seq_len_range=(int(s.min()), int(s.max())),
    )


def fit_expert(
    samples: Sequence[Sequence[float]], *, tp: int = 1, experts_per_node: int = 1, gpu: str = "",
    relative: bool = False,
) -> ExpertCost:
    """Fit ``Te = k3 * b_e + k4`` to ``(batch, seconds)`` or ``(batch, seq_len, seconds)`` samples
    (``relative``: minimise relative errors)."""
    arr = np.asarray(samples, dtype=float)
    if arr.ndim != 2 or arr.shape[1] not in (2, 3) or len(arr) < 2:
        raise ValueError("fit_expert needs at least 2 (batch, seconds) samples")
    b, t = arr[:, 0], arr[:, -1]
    if np.ptp(b) == 0:
        raise ValueError("fit_expert needs at least two different batch sizes")
    k3, k4 = _nonneg_lstsq(np.column_stack([b, np.ones_like(b)]), t, 1.0 / np.maximum(t, 1e-12) if relative else None)
    return ExpertCost(
        k3=float(k3),
        k4=float(k4),
        tp=tp,
        experts_per_node=experts_per_node,
        gpu=gpu,
        n_samples=len(arr),
        rmse_s=_rmse(k3 * b + k4, t),
    )


def fit_network(samples: Sequence[Sequence[float]], nominal_Bps: float | None = None) -> NetworkProfile:
    """Fit ``t = latency + size / bandwidth`` to ``(message bytes, seconds)`` samples.

    Minimises the *relative* error (weights ``1/t``) so small and large messages count alike.
    ``util_curve()`` of the result is the Util of Eq. 6 relative to ``nominal_Bps``.
    """
    arr = np.asarray(samples, dtype=float)
    if arr.ndim != 2 or arr.shape[1] != 2 or len(arr) < 2:
        raise ValueError("fit_network needs at least 2 (bytes, seconds) samples")
    size, t = arr[:, 0], arr[:, 1]
    if np.ptp(size) == 0:
        raise ValueError("fit_network needs at least two different message sizes")
    if np.any(t <= 0):
        raise ValueError("fit_network: times must be positive")
    alpha, inv_bw = _nonneg_lstsq(np.column_stack([np.ones_like(size), size]), t, w=1.0 / t)
    if inv_bw <= 0:
        raise ValueError("fit_network: time does not grow with message size; cannot fit a bandwidth")
    return NetworkProfile(latency_s=float(alpha), bandwidth_Bps=float(1.0 / inv_bw), nominal_Bps=nominal_Bps)


def fit(
    model: str,
    attention_samples: Sequence[Sequence[float]] | None = None,
    expert_samples: Sequence[Sequence[float]] | None = None,
    network_samples: Sequence[Sequence[float]] | None = None,
    *,
    gpu: str = "",
    attention_gpu: str | None = None,
    expert_gpu: str | None = None,
    tp_a: int = 1,
    tp_e: int = 1,
    experts_per_node: int = 1,
    nominal_Bps: float | None = None,
    wire: WireFormat | None = None,
    device: str = "",
    notes: str = "",
    keep_samples: bool = True,
    base: Profile | None = None,
) -> Profile:
    """Fit k1..k4 and the network curve from measurements and return a (merged) :class:`Profile`.

    ``attention_samples``: ``(batch per micro-batch, average seq_len, seconds per layer)``;
    ``expert_samples``: ``(token-expert pairs received, seconds per layer)``;
    ``network_samples``: ``(message bytes, seconds)``.  Entries fitted here replace entries of
    ``base`` with the same (gpu, tp[, experts_per_node]); others of ``base`` are kept.
    """
    a_gpu = attention_gpu if attention_gpu is not None else gpu
    e_gpu = expert_gpu if expert_gpu is not None else gpu
    prof = base or Profile(model=model)
    att = list(prof.attention)
    exp = list(prof.expert)
    samples: dict[str, list[list[float]]] = dict(prof.samples or {})
    if attention_samples is not None:
        c = fit_attention(attention_samples, tp=tp_a, gpu=a_gpu)
        att = [x for x in att if not (x.tp == tp_a and x.gpu.lower() == a_gpu.lower())] + [c]
        samples["attention"] = [list(map(float, s)) for s in attention_samples]
    if expert_samples is not None:
        e = fit_expert(expert_samples, tp=tp_e, experts_per_node=experts_per_node, gpu=e_gpu)
        exp = [
            x
            for x in exp
            if not (x.tp == tp_e and x.experts_per_node == experts_per_node and x.gpu.lower() == e_gpu.lower())
        ] + [e]
        samples["expert"] = [list(map(float, s)) for s in expert_samples]
    network = prof.network
    if network_samples is not None:
        network = fit_network(network_samples, nominal_Bps=nominal_Bps)
        samples["network"] = [list(map(float, s)) for s in network_samples]
    return replace(
        prof,
        model=model,
        attention=tuple(att),
        expert=tuple(exp),
        network=network,
        wire=wire or prof.wire,
        estimate=False,
        device=device or prof.device,
        notes=notes or prof.notes,
        samples=samples if keep_samples else None,
    )


@dataclass
class TransportSamples:
    """Samples of :func:`measure_transport` (``[bytes, seconds]`` each)."""

    oneway: list[list[float]] = field(default_factory=list)  # half the round trip, both sides spinning
    send: list[list[float]] = field(default_factory=list)  # Links.send, receiver spinning or busy
    send_ring: list[list[float]] = field(default_factory=list)  # Links.send, receiver asleep in poll
    take: list[list[float]] = field(default_factory=list)  # gather + release of an arrived message
    wake: list[list[float]] = field(default_factory=list)  # extra delay to a receiver asleep in poll

    def as_dict(self) -> dict[str, list[list[float]]]:
        return {"oneway": self.oneway, "send": self.send, "send_ring": self.send_ring, "take": self.take,
                "wake": self.wake}


def fit_nondecreasing(samples: Sequence[Sequence[float]]) -> tuple[tuple[float, float], ...]:
    """The least-squares non-decreasing fit (isotonic regression, pool-adjacent-violators) of
    ``(x, y)`` samples, as ``(x, fitted y)`` points in ``x`` order: for quantities that cannot fall as
    the work grows (a kernel's speed-up on more threads), so one noisy sample does not shape them."""
    pts = sorted((float(x), float(y)) for x, y in samples)
    blocks: list[list[float]] = []  # [sum of y, count]
    for _, y in pts:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            tot, n = blocks.pop()
            blocks[-1][0] += tot
            blocks[-1][1] += n
    ys = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return tuple((x, y) for (x, _), y in zip(pts, ys))


def fit_runtime(transport: TransportSamples, attention: Sequence[Sequence[float]], cores: int,
                spin_s: float) -> RuntimeCosts:
    """Runtime costs from the transport samples and the attention rows with more than one expert
    worker (see :class:`afdserve.planner.costs.RuntimeCosts`)."""
    (send_s, send_b), _ = fit_affine([[1.0] * len(transport.send), [r[0] for r in transport.send]],
                                     [r[1] for r in transport.send], relative=True)
    ring = [r[1] - (send_s + send_b * r[0]) for r in transport.send_ring]
    one = {(r[0], r[1]): r[3] for r in attention if r[2] == 1}
    extra = [(r[3] - one[(r[0], r[1])]) / (r[2] - 1) for r in attention if r[2] > 1 and (r[0], r[1]) in one]
    return RuntimeCosts(
        cores=cores,
        send_s=send_s,
        send_per_byte_s=send_b,
        ring_s=max(0.0, float(np.median(ring))) if ring else 0.0,
        take_s=float(np.median([r[1] for r in transport.take])) if transport.take else 0.0,
        wake_s=float(np.median([r[1] for r in transport.wake])) if transport.wake else 0.0,
        spin_s=spin_s,
        dispatch_per_worker_s=max(0.0, float(np.median(extra))) if extra else 0.0,
    )
