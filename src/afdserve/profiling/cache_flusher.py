"""Evicting the CPU caches before a timed call, as a deployment's worker finds them.

The worker processes share the last-level cache (LLC) and each streams far more than it holds
between two calls of the same layer (an expert worker reads every layer's weights once per step,
the attention worker its LM head), so a layer never finds its weights cached.
"""

from __future__ import annotations

import torch

from afdserve.profiling.probes import llc_bytes

__all__ = ["CacheFlusher"]


class CacheFlusher:
    """Evicts the CPU caches by writing a buffer of ``factor`` x the LLC size (no-op when disabled)."""

    def __init__(self, enabled: bool = True, factor: float = 2.0):
        self.enabled = enabled
        n = int(llc_bytes() * factor) if enabled else 0
        self._buf = torch.empty(max(n // 4, 1), dtype=torch.float32)
        self._val = 0.0

    def __call__(self) -> None:
        if self.enabled:
            self._val += 1.0
            self._buf.fill_(self._val)
