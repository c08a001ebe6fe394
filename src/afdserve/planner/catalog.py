"""Hardware catalog: per-GPU price, memory, bandwidth, compute, power and network.

Built-in entries (:data:`BUILTIN_GPUS`):

* L20, H800, A800, H20, L40S -- price (normalised so that L20 = 1.00), memory capacity, memory
  bandwidth and compute are Table 3 of the MegaScale-Infer paper (arXiv 2504.02263).
* A100, H100, H200, B200, GB200 -- NVIDIA data sheets (cited per entry).  They have no sourced price
  (``price=None``): add one in a catalog TOML file to rank them by throughput per cost.

Power is the board's maximum power (TDP).  ``net_gbps`` is the scale-out NIC bandwidth *per GPU*
(a property of the server, not of the chip; see each entry's note), ``intra_node_gbs`` the
bidirectional NVLink/PCIe bandwidth per GPU, used for tensor-parallel synchronisation and the
all-to-all of colocated expert parallelism among the ``nvlink_domain`` GPUs it joins (8: a server).

Users add GPUs or override fields in a TOML file (see :func:`load_catalog`)::

    [gpu.MI300X]
    memory_gb = 192
    mem_bw_gbs = 5300
    tflops = 1307
    power_w = 750
    net_gbps = 400
    intra_node_gbs = 896
    price = 3.1
    source = "AMD MI300X data sheet; price: our contract"

    [gpu.H100]          # override only some fields of a built-in entry
    price = 4.6
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from afdserve.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["GPUSpec", "BUILTIN_GPUS", "Catalog", "load_catalog", "TABLE3_GPUS"]

GB = 1e9


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator type.  Units are the ones spec sheets use (GB, GB/s, TFLOPS, W, Gbit/s)."""

    name: str
    memory_gb: float  # HBM/GDDR capacity
    mem_bw_gbs: float  # memory bandwidth, GB/s
    tflops: float  # dense BF16/FP16 tensor-core TFLOPS
    power_w: float  # maximum board power
    net_gbps: float  # scale-out network bandwidth per GPU, Gbit/s
    intra_node_gbs: float  # NVLink / PCIe bandwidth per GPU (bidirectional), GB/s
    price: float | None = None  # relative price (L20 = 1.00), None when no sourced price
    source: str = ""
    nvlink_domain: int = 8  # GPUs joined by intra_node_gbs (a server; 72 in an NVL72 rack)

    def __post_init__(self) -> None:
        for f in ("memory_gb", "mem_bw_gbs", "tflops", "power_w", "net_gbps", "intra_node_gbs"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ConfigError(f"GPU {self.name!r}: {f} must be a positive number, got {v!r}")
        if self.price is not None and not self.price > 0:
            raise ConfigError(f"GPU {self.name!r}: price must be positive, got {self.price!r}")
        if not (isinstance(self.nvlink_domain, int) and self.nvlink_domain >= 1):
            raise ConfigError(f"GPU {self.name!r}: nvlink_domain must be an integer >= 1, got {self.nvlink_domain!r}")

    # SI conversions used by the performance model
    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * GB

    @property
    def mem_bw_Bps(self) -> float:
        return self.mem_bw_gbs * GB

    @property
    def flops(self) -> float:
        return self.tflops * 1e12

    @property
    def net_Bps(self) -> float:
        """Network bandwidth per GPU in bytes/s (``W_a`` / ``W_e`` of Eq. 6)."""
        return self.net_gbps * 1e9 / 8

    @property
    def intra_node_Bps_per_direction(self) -> float:
        return self.intra_node_gbs * GB / 2

    @property
    def ridge_batch(self) -> float:
        """Roofline ridge point in tokens for a bf16 GEMM: ``F / B`` (paper §2.3)."""
        return self.flops / self.mem_bw_Bps


_T3 = "MegaScale-Infer (arXiv 2504.02263) Table 3"
# Network per GPU.  Paper §7.1: the Ampere (A800) cluster has 8x200 Gb/s NICs per 8-GPU node,
# H20 nodes 4x400 Gb/s, L40S nodes 2x400 Gb/s (we assume 8 L40S per node).
BUILTIN_GPUS: dict[str, GPUSpec] = {
    "L20": GPUSpec(
        "L20",
        memory_gb=48,
        mem_bw_gbs=864,
        tflops=119.5,
        power_w=275,
        net_gbps=100,
        intra_node_gbs=64,
        price=1.00,
        source=f"{_T3}; power 275 W (L20 board power as listed by GPU spec databases, e.g. technical.city, "
        "topcpu.net); PCIe Gen4 x16; network assumed as the paper's PCIe (L40S) nodes",
    ),
    "H800": GPUSpec(
        "H800",
        memory_gb=80,
        mem_bw_gbs=3430.4,
        tflops=989,
        power_w=700,
        net_gbps=400,
        intra_node_gbs=400,
        price=5.28,
        source=f"{_T3}; power: H800 SXM5 700 W; NVLink 400 GB/s; network: 50 GB/s IB per GPU "
        "(DeepSeek-V3 report, arXiv 2412.19437, §3.2.2)",
    ),
    "A800": GPUSpec(
        "A800",
        memory_gb=80,
        mem_bw_gbs=2039,
        tflops=312,
        power_w=400,
        net_gbps=200,
        intra_node_gbs=400,
        price=2.26,
        source=f"{_T3}; power: A800 SXM4 400 W (as A100 SXM4); NVLink 400 GB/s and 200 Gb/s NIC per GPU "
        "(paper §7.1 Ampere testbed)",
    ),
    "H20": GPUSpec(
        "H20",
        memory_gb=96,
        mem_bw_gbs=4096,
        tflops=148,
        power_w=500,
        net_gbps=200,
        intra_node_gbs=900,
        price=1.85,
        source=f"{_T3}; power 500 W (paper §4.3); NVLink 900 GB/s and 4x400 Gb/s per 8-GPU node (paper §7.1)",
    ),
    "L40S": GPUSpec(
        "L40S",
        memory_gb=48,
        mem_bw_gbs=864,
        tflops=362,
        power_w=350,
        net_gbps=100,
        intra_node_gbs=64,
        price=1.08,
        source=f"{_T3}; power 350 W (paper §4.3); PCIe Gen4 x16; 2x400 Gb/s per node (paper §7.1), 8 GPUs/node assumed",
    ),
    # ---- not in Table 3: NVIDIA data sheets, no sourced price --------------------------------
    "A100": GPUSpec(
        "A100",
        memory_gb=80,
        mem_bw_gbs=2039,
        tflops=312,
        power_w=400,
        net_gbps=200,
        intra_node_gbs=600,
        price=None,
        source="NVIDIA A100 Tensor Core GPU data sheet (A100 80GB SXM: BF16 312 TFLOPS dense, 2,039 GB/s, "
        "400 W, NVLink 600 GB/s); network: DGX A100 8x200 Gb/s ConnectX-6 for 8 GPUs",
    ),
    "H100": GPUSpec(
        "H100",
        memory_gb=80,
        mem_bw_gbs=3350,
        tflops=989,
        power_w=700,
        net_gbps=400,
        intra_node_gbs=900,
        price=None,
        source="NVIDIA H100 Tensor Core GPU data sheet (H100 SXM: BF16 1,979 TFLOPS with sparsity = 989 dense, "
        "3.35 TB/s, up to 700 W, NVLink 900 GB/s); network: DGX H100 8x400 Gb/s ConnectX-7 for 8 GPUs",
    ),
    "H200": GPUSpec(
        "H200",
        memory_gb=141,
        mem_bw_gbs=4800,
        tflops=989,
        power_w=700,
        net_gbps=400,
        intra_node_gbs=900,
        price=None,
        source="NVIDIA H200 Tensor Core GPU data sheet (H200 SXM: 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS "
        "with sparsity = 989 dense, up to 700 W, NVLink 900 GB/s); network: DGX H200 8x400 Gb/s for 8 GPUs",
    ),
    "B200": GPUSpec(
        "B200",
        memory_gb=180,
        mem_bw_gbs=8000,
        tflops=2250,
        power_w=1000,
        net_gbps=400,
        intra_node_gbs=1800,
        price=None,
        source="NVIDIA HGX B200 spec (8 GPUs: 1.44 TB HBM3e, 64 TB/s, BF16 36 PFLOPS with sparsity -> per GPU "
        "180 GB, 8 TB/s, 2.25 PFLOPS dense); 1000 W per GPU; NVLink 1.8 TB/s; DGX B200 8x400 Gb/s for 8 GPUs",
    ),
    "GB200": GPUSpec(
        "GB200",
        memory_gb=186,
        mem_bw_gbs=8000,
        tflops=2500,
        power_w=1200,
        net_gbps=400,
        intra_node_gbs=1800,
        price=None,
        nvlink_domain=72,
        source="NVIDIA GB200 NVL72 spec (72 Blackwell GPUs: 13.4 TB HBM3e, 576 TB/s, FP16/BF16 360 PFLOPS with "
        "sparsity -> per GPU 186 GB, 8 TB/s, 2.5 PFLOPS dense; NVLink 1.8 TB/s per GPU in one 72-GPU domain); "
        "power: 2,700 W per GB200 superchip (2 GPUs + Grace), 1,200 W per GPU assumed; one 400 Gb/s "
        "ConnectX-7 per GPU",
    ),
}

#: The GPUs of the paper's Table 3 -- the ones with a sourced price.
TABLE3_GPUS: tuple[str, ...] = ("L20", "H800", "A800", "H20", "L40S")

_FIELDS = {f.name for f in fields(GPUSpec)} - {"name"}


class Catalog:
    """A name -> :class:`GPUSpec` mapping with case-insensitive lookup."""

    def __init__(self, gpus: Iterable[GPUSpec]) -> None:
        self._gpus: dict[str, GPUSpec] = {}
        for g in gpus:
            self._gpus[g.name] = g

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._find(name) is not None

    def __iter__(self) -> Iterator[GPUSpec]:
        return iter(self._gpus.values())

    def __len__(self) -> int:
        return len(self._gpus)

    def names(self) -> list[str]:
        return list(self._gpus)

    def _find(self, name: str) -> GPUSpec | None:
        key = name.strip().lower()
        for n, g in self._gpus.items():
            if n.lower() == key:
                return g
        return None

    def get(self, name: str) -> GPUSpec:
        g = self._find(name)
        if g is None:
            raise ConfigError(f"unknown GPU {name!r}; known: {', '.join(self._gpus)} (add it in a catalog TOML file)")
        return g

    def priced(self) -> list[GPUSpec]:
        return [g for g in self._gpus.values() if g.price is not None]

    def with_updates(self, entries: Mapping[str, Mapping[str, Any]], source: str = "catalog") -> Catalog:
        gpus = dict(self._gpus)
        for name, values in entries.items():
            unknown = set(values) - _FIELDS
            if unknown:
                raise ConfigError(
                    f"{source}: GPU {name!r}: unknown field(s) {sorted(unknown)}; allowed: {sorted(_FIELDS)}"
                )
            base = self._find(name)
            try:
                if base is not None:
                    g = replace(base, **dict(values))
                    gpus[base.name] = g
                else:
                    missing = {"memory_gb", "mem_bw_gbs", "tflops", "power_w", "net_gbps", "intra_node_gbs"} - set(
                        values
                    )
                    if missing:
                        raise ConfigError(f"{source}: new GPU {name!r} is missing {sorted(missing)}")
                    gpus[name] = GPUSpec(name=name, **dict(values))
            except TypeError as e:
                raise ConfigError(f"{source}: GPU {name!r}: {e}") from e
        return Catalog(gpus.values())


def load_catalog(path: str | Path | None = None) -> Catalog:
    """The built-in catalog, updated with the ``[gpu.NAME]`` tables of a TOML file if given."""
    cat = Catalog(BUILTIN_GPUS.values())
    if path is None:
        return cat
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read catalog {p}: {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}") from e
    entries = data.get("gpu")
    if not isinstance(entries, dict) or not entries:
        raise ConfigError(f"{p}: expected one or more [gpu.NAME] tables")
    return cat.with_updates(entries, source=str(p))
