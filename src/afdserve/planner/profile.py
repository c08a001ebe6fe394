"""Profiles: the measured constants of the performance model, their file format, and ``fit``.

The planner models one micro-batch's compute as (MegaScale-Infer §4.2)

* attention: ``Ta = k1 * b_a + k2`` with the KV-cache read making ``k1`` grow with the average
  sequence length ``s``; we store ``k1(s) = k1_tok + k1_ctx * s``;
* experts: ``Te = k3 * b_e + k4`` (``b_e`` = token-expert pairs an expert node receives);

and the network with a bandwidth-utilisation curve ``Util(message bytes)`` (Eq. 6).  A
:class:`Profile` holds those constants per GPU and TP size, as measured by the profiler (or written
by hand).  :func:`fit` turns raw measurements into a profile by least squares.

File format (JSON, ``"format": "afdserve-planner-profile"``, ``"version": 1``)::

    {
      "format": "afdserve-planner-profile", "version": 1,
      "model": "demo", "device": "NVIDIA H100 80GB HBM3", "estimate": false,
      "attention": [{"gpu": "H100", "tp": 1, "k1_tok": 1.1e-06, "k1_ctx": 2.0e-09, "k2": 3.0e-04,
                     "n_samples": 24, "rmse_s": 4e-06, "seq_len_range": [128, 2048]}],
      "expert":    [{"gpu": "H100", "tp": 1, "experts_per_node": 4, "k3": 8e-07, "k4": 2e-04,
                     "n_samples": 12, "rmse_s": 3e-06}],
      "network":   {"latency_s": 2.5e-05, "bandwidth_Bps": 9.0e+09, "nominal_Bps": null, "points": []},
      "wire":      {"act_bytes": 2, "meta_bytes_per_token": 0, "dispatch": "routed"},
      "step":      {"fixed_s": 0.0, "per_token_s": 0.0},
      "runtime":   {"cores": 2, "send_s": 1.6e-05, "send_per_byte_s": 4e-11, "ring_s": 2e-05,
                    "take_s": 6e-05, "wake_s": 6e-05, "spin_s": 5e-05, "dispatch_per_worker_s": 2e-05},
      "samples":   {"attention": [[b, s, t], ...], "expert": [[b, t], ...], "network": [[bytes, t], ...]},
      "notes": ""
    }

Times are seconds, sizes bytes.  ``gpu`` is matched case-insensitively against catalog names; an
empty ``gpu`` (or ``"*"``) matches any GPU.  ``samples`` is optional (kept for re-fitting).
``runtime`` is optional: the costs of this repository's runtime around the model's compute, which
``afdserve profile`` measures and the local model (:mod:`afdserve.planner.local`) uses.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from afdserve.errors import ConfigError

__all__ = [
    "AttentionCost",
    "ExpertCost",
    "UtilCurve",
    "NetworkProfile",
    "WireFormat",
    "RuntimeCosts",
    "Profile",
    "fit_attention",
    "fit_expert",
    "fit_network",
    "fit_affine",
    "fit",
    "load_profile",
    "save_profile",
    "PROFILE_FORMAT",
]

PROFILE_FORMAT = "afdserve-planner-profile"
PROFILE_VERSION = 1


def _gpu_matches(entry_gpu: str, gpu: str) -> bool:
    return entry_gpu in ("", "*") or entry_gpu.strip().lower() == gpu.strip().lower()


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
      time-share them (0: every worker has its own core or device).
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

    def lm_head_time(self, b: float) -> float:
        if len(self.lm_head_points) >= 2:  # piecewise linear between the measured points
            xs = [p[0] for p in self.lm_head_points]
            ys = [p[1] for p in self.lm_head_points]
            if xs[0] <= b <= xs[-1]:
                return float(np.interp(b, xs, ys))
        return self.lm_head_s + self.lm_head_per_token_s * b

    def send_time(self, nbytes: float, receiver_asleep: bool = False) -> float:
        return self.send_s + self.send_per_byte_s * nbytes + (self.ring_s if receiver_asleep else 0.0)


@dataclass(frozen=True)
class Profile:
    """Measured constants of the performance model for one model (see module docstring)."""

    model: str
    attention: tuple[AttentionCost, ...] = ()
    expert: tuple[ExpertCost, ...] = ()
    network: NetworkProfile | None = None
    wire: WireFormat = field(default_factory=WireFormat)
    step_fixed_s: float = 0.0
    step_per_token_s: float = 0.0
    runtime: RuntimeCosts | None = None
    estimate: bool = False
    device: str = ""
    notes: str = ""
    samples: dict[str, list[list[float]]] | None = None

    def attention_cost(self, gpu: str, tp: int) -> AttentionCost | None:
        for c in self.attention:
            if c.tp == tp and _gpu_matches(c.gpu, gpu):
                return c
        return None

    def expert_cost(self, gpu: str, tp: int, experts_per_node: int) -> ExpertCost | None:
        for c in self.expert:
            if c.tp == tp and c.experts_per_node == experts_per_node and _gpu_matches(c.gpu, gpu):
                return c
        return None

    # ----- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def clean(d: dict[str, Any]) -> dict[str, Any]:
            return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}

        out: dict[str, Any] = {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "model": self.model,
            "device": self.device,
            "estimate": self.estimate,
            "attention": [clean(asdict(c)) for c in self.attention],
            "expert": [clean(asdict(c)) for c in self.expert],
            "network": None
            if self.network is None
            else {**asdict(self.network), "points": [list(p) for p in self.network.points]},
            "wire": asdict(self.wire),
            "step": {"fixed_s": self.step_fixed_s, "per_token_s": self.step_per_token_s},
            "notes": self.notes,
        }
        if self.runtime is not None:
            out["runtime"] = {**asdict(self.runtime),
                              "lm_head_points": [list(p) for p in self.runtime.lm_head_points]}
        if self.samples is not None:
            out["samples"] = self.samples
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "profile") -> Profile:
        if d.get("format") != PROFILE_FORMAT:
            raise ConfigError(f"{source}: not an afdserve planner profile (format={d.get('format')!r})")
        if int(d.get("version", 0)) != PROFILE_VERSION:
            raise ConfigError(f"{source}: unsupported profile version {d.get('version')!r}")
        try:
            att = tuple(
                AttentionCost(
                    k1_tok=float(a["k1_tok"]),
                    k1_ctx=float(a.get("k1_ctx", 0.0)),
                    k2=float(a["k2"]),
                    tp=int(a.get("tp", 1)),
                    gpu=str(a.get("gpu", "")),
                    n_samples=int(a.get("n_samples", 0)),
                    rmse_s=None if a.get("rmse_s") is None else float(a["rmse_s"]),
                    seq_len_range=None
                    if a.get("seq_len_range") is None
                    else (int(a["seq_len_range"][0]), int(a["seq_len_range"][1])),
                )
                for a in d.get("attention", [])
            )
            exp = tuple(
                ExpertCost(
                    k3=float(e["k3"]),
                    k4=float(e["k4"]),
                    tp=int(e.get("tp", 1)),
                    experts_per_node=int(e.get("experts_per_node", 1)),
                    gpu=str(e.get("gpu", "")),
                    n_samples=int(e.get("n_samples", 0)),
                    rmse_s=None if e.get("rmse_s") is None else float(e["rmse_s"]),
                )
                for e in d.get("expert", [])
            )
            net_d = d.get("network")
            net = None
            if net_d:
                net = NetworkProfile(
                    latency_s=float(net_d["latency_s"]),
                    bandwidth_Bps=float(net_d["bandwidth_Bps"]),
                    nominal_Bps=None if net_d.get("nominal_Bps") is None else float(net_d["nominal_Bps"]),
                    points=tuple((float(p[0]), float(p[1])) for p in net_d.get("points", [])),
                )
            wire = WireFormat(**d["wire"]) if d.get("wire") else WireFormat()
            step = d.get("step") or {}
            rt_d = d.get("runtime")
            runtime = None
            if rt_d:
                known = {f.name for f in fields(RuntimeCosts)}

                def conv(k: str, v: Any) -> Any:
                    if k == "cores":
                        return int(v)
                    if k == "lm_head_points":
                        return tuple(sorted((float(p[0]), float(p[1])) for p in v))
                    return float(v)

                runtime = RuntimeCosts(**{k: conv(k, v) for k, v in rt_d.items() if k in known})
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ConfigError(f"{source}: malformed profile: {e!r}") from e
        return cls(
            model=str(d.get("model", "")),
            attention=att,
            expert=exp,
            network=net,
            wire=wire,
            step_fixed_s=float(step.get("fixed_s", 0.0)),
            step_per_token_s=float(step.get("per_token_s", 0.0)),
            runtime=runtime,
            estimate=bool(d.get("estimate", False)),
            device=str(d.get("device", "")),
            notes=str(d.get("notes", "")),
            samples=d.get("samples"),
        )


def load_profile(path: str | Path) -> Profile:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read profile {p}: {e}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: invalid JSON: {e}") from e
    return Profile.from_dict(data, source=str(p))


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_dict(), indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# Fitting
# --------------------------------------------------------------------------------------------
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
