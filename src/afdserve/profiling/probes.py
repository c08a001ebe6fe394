"""What this machine is: its CPU, cores, last-level cache, and how idle it is."""

from __future__ import annotations

import time
from pathlib import Path

from afdserve.config import cpu_cores, cpuinfo

__all__ = ["llc_bytes", "cpu_cores", "idle_fraction", "cpu_name"]


def llc_bytes() -> int:
    """Size of the largest CPU cache (sysfs; 32 MiB when unknown)."""
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in base.glob("index*"):
        try:
            text = (idx / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best or (32 << 20)


def idle_fraction(seconds: float = 1.0) -> float:
    """Fraction of the machine's CPU time that was idle over ``seconds`` (/proc/stat; 1.0 if unknown)."""
    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)

    try:
        a = read()
        time.sleep(seconds)
        b = read()
    except (OSError, ValueError, IndexError):
        return 1.0
    return (b[0] - a[0]) / max(1, b[1] - a[1])


def cpu_name() -> str:
    return cpuinfo("model name")
