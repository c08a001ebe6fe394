"""What the plan search explores and how it ranks plans (:class:`SearchConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from afdserve.errors import ConfigError
from afdserve.planner.roofline import RooflineOptions

__all__ = ["SearchConfig", "DEFAULT_SEQ_LEN", "Objective"]

Objective = Literal["auto", "cost", "gpu", "watt"]

#: Average decoding sequence length: the paper's workload has median input 571 and output 159
#: tokens (§7.1); halfway through decoding a sequence holds 571 + 159/2 ~ 650 tokens.
DEFAULT_SEQ_LEN = 650


@dataclass(frozen=True)
class SearchConfig:
    slo_s: float = 0.150  # time-between-tokens SLO (paper §7.1: 150 ms)
    seq_len: float = DEFAULT_SEQ_LEN
    tp_choices: tuple[int, ...] = (1, 2, 4, 8)
    max_micro_batches: int = 4  # N_m
    min_micro_batches: int = 1
    na_radius: int = 2  # n_a candidates: balance rule +- radius
    max_n_a: int = 1024
    experts_per_node: tuple[int, ...] | None = None  # None: powers of two dividing E
    require_overlap: bool = False  # keep only plans meeting constraints (2) and (3)
    max_b_a: int = 1 << 16
    roofline: RooflineOptions = field(default_factory=RooflineOptions)
    link_latency_s: float = 0.0  # per-message latency for the estimated Util curve
    allow_roofline_fallback: bool = False  # with a profile: estimate what it does not cover
    objective: Objective = "auto"

    def __post_init__(self) -> None:
        if self.slo_s <= 0 or self.seq_len <= 0:
            raise ConfigError("slo_s and seq_len must be positive")
        if not 1 <= self.min_micro_batches <= self.max_micro_batches:
            raise ConfigError("need 1 <= min_micro_batches <= max_micro_batches")
        if not self.tp_choices or any(t < 1 for t in self.tp_choices):
            raise ConfigError("tp_choices must be positive integers")
