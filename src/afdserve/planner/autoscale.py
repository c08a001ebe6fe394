"""The autoscaling policy for the two pools: live signals in, a pool-size decision out.

A pure object: ``AutoscalePolicy.decide(signals, now)`` reads one ``Signals`` sample and returns a
``Decision`` (grow or shrink one pool by one allowed size, or hold, always with a reason); the
caller applies it (``afdserve.serving.autoscaler`` calls the live resize, ``afdserve.planner.
autoscale_day`` a simulated deployment) and reports back with ``resized`` or ``resize_failed``. The
clock is the caller's ``now``: nothing here sleeps or reads the wall clock.

The rule (thresholds in ``AutoscaleConfig``):

* *pressure up* -- TPOT or TTFT above ``up_fraction`` x their SLO, or more than ``queue_up``
  requests waiting, or the fullest attention worker's KV cache above ``kv_up``;
* *pressure down* -- nothing waiting, KV below ``kv_down``, TPOT below ``down_fraction`` x SLO (or
  no token at all: idle) and TTFT likewise;
* a pressure acts only once it has held for ``window_s`` (hysteresis: the up and down thresholds
  differ and each must be sustained) and ``cooldown_s`` after the last resize (applied or failed);
* which pool: growing, attention when KV is the limit (only attention workers hold KV); else, with
  the planner's model (``PoolModel``: the TPOT predicted at a pool size and demand), the pool whose
  growth predicts the lower TPOT (the balance of ``Ta`` and ``Te``); else the busier pool by the
  measured busy fractions. Shrinking: the pool whose removal predicts the lower TPOT (or the less
  busy one), and with a model only when the smaller deployment would serve ``1/down_safety`` x the
  current demand below ``up_fraction`` x SLO (so a shrink does not invite the next grow).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

from afdserve.errors import ConfigError

Pool = Literal["attention", "experts"]
Action = Literal["up", "down", "hold"]


class PoolModel(Protocol):
    """The planner's prediction for ``n_a`` attention and ``n_e`` expert workers."""

    def tpot(self, n_a: int, n_e: int, demand_tok_s: float) -> float:
        """Decode TPOT (seconds) serving ``demand_tok_s`` decode tokens per second (inf: they cannot)."""
        ...

    def capacity(self, n_a: int, n_e: int) -> float:
        """Decode tokens per second they serve within the TPOT SLO."""
        ...


def parse_bounds(text: str, what: str) -> tuple[int, int]:
    """``"LO:HI"`` (or ``"N"``: a fixed size) -> (lo, hi); ConfigError on anything else."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if len(parts) > 2 or lo < 1 or hi < lo:
        raise ConfigError(f"invalid {what} bounds {text!r}: expected MIN:MAX with 1 <= MIN <= MAX (e.g. 1:3)")
    return lo, hi


@dataclass(frozen=True)
class AutoscaleConfig:
    attention_sizes: tuple[int, ...]  # the sizes the attention pool may take, ascending
    expert_sizes: tuple[int, ...]
    slo_tpot_s: float
    slo_ttft_s: float | None = None
    up_fraction: float = 0.9  # TPOT / TTFT above this share of the SLO: pressure up
    down_fraction: float = 0.5  # ... below this share (and nothing waiting): pressure down
    queue_up: int = 0  # more requests waiting than this: pressure up
    kv_up: float = 0.8  # the fullest attention worker's KV usage above this: pressure up (grow attention)
    kv_down: float = 0.5
    window_s: float = 10.0  # a pressure must hold this long before it acts
    cooldown_s: float = 30.0  # no resize sooner than this after the last one (applied or failed)
    down_safety: float = 0.7  # with a model: shrink only if the smaller pools serve demand / this within
    #                            up_fraction x SLO

    def __post_init__(self) -> None:
        for what, sizes in (("attention", self.attention_sizes), ("expert", self.expert_sizes)):
            if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
                raise ConfigError(f"invalid {what} pool sizes {sizes}: need ascending distinct sizes >= 1")
        if not self.slo_tpot_s > 0 or (self.slo_ttft_s is not None and not self.slo_ttft_s > 0):
            raise ConfigError("invalid SLO: slo_tpot_s (and slo_ttft_s if given) must be > 0")
        if not 0 < self.down_fraction < self.up_fraction:
            raise ConfigError(f"invalid thresholds: need 0 < down_fraction ({self.down_fraction}) < up_fraction "
                              f"({self.up_fraction})")
        if not 0 <= self.kv_down < self.kv_up <= 1:
            raise ConfigError(f"invalid KV thresholds: need 0 <= kv_down ({self.kv_down}) < kv_up ({self.kv_up}) <= 1")
        if self.window_s < 0 or self.cooldown_s < 0 or self.queue_up < 0:
            raise ConfigError("invalid window_s / cooldown_s / queue_up: must be >= 0")

    @classmethod
    def from_bounds(cls, attention: tuple[int, int], experts: tuple[int, int], **kw: object) -> AutoscaleConfig:
        return cls(tuple(range(attention[0], attention[1] + 1)), tuple(range(experts[0], experts[1] + 1)),
                   **kw)  # type: ignore[arg-type]

    def sizes(self, pool: Pool) -> tuple[int, ...]:
        return self.attention_sizes if pool == "attention" else self.expert_sizes


@dataclass(frozen=True)
class Signals:
    """One sample of the deployment (rates and latencies over the last sampling interval)."""

    waiting: int = 0  # requests waiting to be scheduled
    running: int = 0
    kv_usage: float = 0.0  # the fullest attention worker's used fraction of its KV blocks
    tpot_s: float | None = None  # mean time between tokens (None: no token in the interval)
    ttft_s: float | None = None  # mean time to first token (None: no first token)
    throughput_tok_s: float = 0.0  # decode tokens per second delivered
    attention_busy: float | None = None  # mean busy fraction of the attention pool
    expert_busy: float | None = None  # ... of the expert pool


@dataclass(frozen=True)
class Decision:
    time: float
    action: Action
    pool: Pool | None  # the pool to resize (up/down) or that a held pressure would resize
    attention: int  # the pool sizes to run (after the action)
    experts: int
    reason: str  # short, for metrics labels: tpot_over_slo, ttft_over_slo, queue, kv_full, underused,
    #              steady, window, cooldown, at_max, at_min, unsafe_shrink
    detail: str = ""  # a sentence with the figures, for the log


@dataclass
class AutoscalePolicy:
    config: AutoscaleConfig
    attention: int  # the current pool sizes
    experts: int
    model: PoolModel | None = None
    last_resize: float = -math.inf
    _up_since: float | None = field(default=None, repr=False)
    _down_since: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for pool, n in (("attention", self.attention), ("experts", self.experts)):
            if n not in self.config.sizes(pool):  # type: ignore[arg-type]
                raise ConfigError(f"the {pool} pool starts at {n}, outside its autoscaling sizes "
                                  f"{list(self.config.sizes(pool))}")  # type: ignore[arg-type]

    # ---- the caller reports what happened ------------------------------------------------
    def resized(self, attention: int, experts: int, now: float) -> None:
        self.attention, self.experts, self.last_resize = attention, experts, now
        self._up_since = self._down_since = None

    def resize_failed(self, now: float) -> None:
        """The sizes stay; the cool-down starts anyway (the next try comes after it)."""
        self.last_resize = now
        self._up_since = self._down_since = None

    # ---- the rule --------------------------------------------------------------------------
    def decide(self, s: Signals, now: float) -> Decision:
        up = self._pressure_up(s)
        down = None if up else self._pressure_down(s)
        self._up_since = (self._up_since if self._up_since is not None else now) if up else None
        self._down_since = (self._down_since if self._down_since is not None else now) if down else None
        if up is not None:
            return self._act("up", up[0], up[1], self._up_since, s, now)  # type: ignore[arg-type]
        if down is not None:
            return self._act("down", "underused", down, self._down_since, s, now)  # type: ignore[arg-type]
        return self._hold(now, None, "steady", "no threshold crossed")

    def _pressure_up(self, s: Signals) -> tuple[str, str] | None:
        c = self.config
        if s.kv_usage > c.kv_up:
            return "kv_full", f"KV usage {s.kv_usage:.2f} > {c.kv_up}"
        if s.tpot_s is not None and s.tpot_s > c.up_fraction * c.slo_tpot_s:
            return "tpot_over_slo", f"TPOT {s.tpot_s * 1e3:.1f} ms > {c.up_fraction} x SLO {c.slo_tpot_s * 1e3:g} ms"
        if c.slo_ttft_s is not None and s.ttft_s is not None and s.ttft_s > c.up_fraction * c.slo_ttft_s:
            return "ttft_over_slo", f"TTFT {s.ttft_s * 1e3:.0f} ms > {c.up_fraction} x SLO {c.slo_ttft_s * 1e3:g} ms"
        if s.waiting > c.queue_up:
            return "queue", f"{s.waiting} requests waiting > {c.queue_up}"
        return None

    def _pressure_down(self, s: Signals) -> str | None:
        c = self.config
        low_tpot = s.tpot_s is None or s.tpot_s < c.down_fraction * c.slo_tpot_s
        low_ttft = c.slo_ttft_s is None or s.ttft_s is None or s.ttft_s < c.down_fraction * c.slo_ttft_s
        if s.waiting == 0 and s.kv_usage < c.kv_down and low_tpot and low_ttft:
            tpot = "no tokens" if s.tpot_s is None else f"TPOT {s.tpot_s * 1e3:.1f} ms < {c.down_fraction} x SLO"
            return f"{tpot}, KV {s.kv_usage:.2f} < {c.kv_down}, nothing waiting"
        return None

    def _act(self, action: Action, reason: str, detail: str, since: float, s: Signals, now: float) -> Decision:
        c = self.config
        pool, sizes, why_not = self._grow(s) if action == "up" else self._shrink(s)
        if pool is None:
            return self._hold(now, None, why_not, f"{detail}; {why_not}")
        if now - since < c.window_s:
            return self._hold(now, pool, "window", f"{detail} for {now - since:.0f} of {c.window_s:g} s")
        if now - self.last_resize < c.cooldown_s:
            return self._hold(now, pool, "cooldown", f"{detail}; cool-down ({now - self.last_resize:.0f} of "
                                                     f"{c.cooldown_s:g} s since the last resize)")
        return Decision(now, action, pool, sizes[0], sizes[1], reason, f"{detail}: {action} {pool} to {sizes}")

    def _hold(self, now: float, pool: Pool | None, reason: str, detail: str) -> Decision:
        return Decision(now, "hold", pool, self.attention, self.experts, reason, detail)

    def _step(self, pool: Pool, delta: int) -> tuple[int, int] | None:
        """The pool sizes one allowed size up (delta > 0) or down from now (a size resized from
        elsewhere, out of the allowed ones, steps to the nearest allowed one)."""
        cur = self.attention if pool == "attention" else self.experts
        ok = [n for n in self.config.sizes(pool) if (n > cur if delta > 0 else n < cur)]
        if not ok:
            return None
        n = ok[0] if delta > 0 else ok[-1]
        return (n, self.experts) if pool == "attention" else (self.attention, n)

    def _demand(self, s: Signals) -> float:
        return s.throughput_tok_s

    def _grow(self, s: Signals) -> tuple[Pool | None, tuple[int, int], str]:
        options = {p: t for p in ("attention", "experts") if (t := self._step(p, +1)) is not None}  # type: ignore
        if not options:
            return None, (self.attention, self.experts), "at_max"
        if s.kv_usage > self.config.kv_up and self.model is None:  # only attention workers hold KV
            return ("attention", options["attention"], "") if "attention" in options else \
                   (None, (self.attention, self.experts), "at_max")
        return self._pick(options, s, grow=True)

    def _shrink(self, s: Signals) -> tuple[Pool | None, tuple[int, int], str]:
        options = {p: t for p in ("attention", "experts") if (t := self._step(p, -1)) is not None}  # type: ignore
        if not options:
            return None, (self.attention, self.experts), "at_min"
        if self.model is not None and s.throughput_tok_s > 0:
            c = self.config
            options = {p: t for p, t in options.items()
                       if self.model.tpot(*t, self._demand(s) / c.down_safety) <= c.up_fraction * c.slo_tpot_s}
            if not options:
                return None, (self.attention, self.experts), "unsafe_shrink"
        return self._pick(options, s, grow=False)

    def _pick(self, options: dict[Pool, tuple[int, int]], s: Signals,
              grow: bool) -> tuple[Pool, tuple[int, int], str]:
        """The pool to resize among ``options``: lowest predicted TPOT (then: highest capacity); else by
        busy fraction."""
        if len(options) == 1:
            pool = next(iter(options))
        elif self.model is not None and s.throughput_tok_s > 0:
            m = self.model
            pred = {p: (m.tpot(*t, self._demand(s)), -m.capacity(*t), p != "attention") for p, t in options.items()}
            pool = min(pred, key=lambda p: pred[p])  # type: ignore[arg-type]
        else:
            a, e = s.attention_busy or 0.0, s.expert_busy or 0.0
            pool = ("experts" if e > a else "attention") if grow else ("attention" if a < e else "experts")
        return pool, options[pool], ""
