"""Profiles: the measured constants of the performance model (:mod:`afdserve.planner.costs`) for
one model, per GPU and TP size, and their file format.  ``afdserve profile`` measures them
(:mod:`afdserve.profiling`), :func:`afdserve.planner.fitting.fit` fits them from measurements, or
they are written by hand.

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

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from afdserve.errors import ConfigError
from afdserve.planner.costs import AttentionCost, ExpertCost, NetworkProfile, RuntimeCosts, WireFormat

__all__ = ["Profile", "load_profile", "save_profile", "attention_request_cost", "PROFILE_FORMAT"]

PROFILE_FORMAT = "afdserve-planner-profile"
PROFILE_VERSION = 1


def _gpu_matches(entry_gpu: str, gpu: str) -> bool:
    return entry_gpu in ("", "*") or entry_gpu.strip().lower() == gpu.strip().lower()


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
            rt = asdict(self.runtime)
            out["runtime"] = {**rt, **{k: [list(p) for p in v] for k, v in rt.items() if k.endswith("_points")}}
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
                    if k.endswith("_points"):
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



def attention_request_cost(path: str | Path) -> Callable[[float], float]:
    """What a request with ``s`` tokens of context adds to an attention worker's decode step,
    ``k1(s)`` of the first attention entry of the profile at ``path``: the cost
    :class:`afdserve.balance.attention.AttentionBalancer` balances."""
    prof = load_profile(path)
    if not prof.attention:
        raise ConfigError(f"{path}: the profile has no attention entry")
    return prof.attention[0].k1
