"""This host's memory-copy bandwidth: the physical ceiling of a shared-memory transfer."""

from __future__ import annotations

import time

import numpy as np


def memcpy_gbps(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Large-buffer copy bandwidth (GB/s) of one core: the physical reference."""
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    best = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(b, a)
        best.append(time.perf_counter() - t)
    return nbytes / float(np.median(best)) / 1e9
