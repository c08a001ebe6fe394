"""A deployment plan and its predicted performance (:class:`Plan`), as the search ranks them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Plan"]


@dataclass(frozen=True)
class Plan:
    """One deployment plan and its predicted performance (times in seconds, memory in GB)."""

    attention_gpu: str
    expert_gpu: str
    tp_a: int
    tp_e: int
    n_a: int
    n_e: int
    experts_per_node: int
    micro_batches: int
    batch: int  # global batch B
    b_a: int  # tokens per micro-batch per attention node
    b_e: float  # token-expert pairs per micro-batch per expert node
    ta_s: float
    te_s: float
    tc_s: float
    tbt_s: float  # iteration time of the global batch = time between tokens
    iter_lower_s: float  # Eq. (4)
    iter_upper_s: float
    throughput_tok_s: float
    throughput_per_gpu: float
    throughput_per_cost: float | None
    throughput_per_watt: float
    num_gpus: int
    cost: float | None
    power_w: float
    attention_mem_per_gpu_gb: float
    expert_mem_per_gpu_gb: float
    balance_ratio: float
    comm_hidden: bool
    pipeline_full: bool
    min_micro_batches: int
    source: str  # "roofline-estimate" | "profile" | "profile+roofline"

    @property
    def heterogeneous(self) -> bool:
        return self.attention_gpu != self.expert_gpu

    def objective_value(self, objective: str) -> float:
        if objective == "cost":
            return self.throughput_per_cost if self.throughput_per_cost is not None else -math.inf
        if objective == "watt":
            return self.throughput_per_watt
        return self.throughput_per_gpu

    def to_json(self) -> dict[str, Any]:
        """The CLI's JSON record: the documented keys first, then the details."""
        d = asdict(self)
        head = {
            "attention_gpu": self.attention_gpu,
            "expert_gpu": self.expert_gpu,
            "tp_a": self.tp_a,
            "tp_e": self.tp_e,
            "n_a": self.n_a,
            "n_e": self.n_e,
            "micro_batches": self.micro_batches,
            "batch": self.batch,
            "tbt_ms": self.tbt_s * 1e3,
            "throughput_tok_s": self.throughput_tok_s,
            "throughput_per_gpu": self.throughput_per_gpu,
            "throughput_per_cost": self.throughput_per_cost,
            "throughput_per_watt": self.throughput_per_watt,
        }
        extra = {k: v for k, v in d.items() if k not in head and k != "tbt_s"}
        for k in ("ta_s", "te_s", "tc_s", "iter_lower_s", "iter_upper_s"):
            extra[k.replace("_s", "_ms")] = extra.pop(k) * 1e3
        return {**head, **extra}
