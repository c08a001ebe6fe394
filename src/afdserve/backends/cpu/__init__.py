"""afdserve's C++ CPU kernels as backends: one fused MoE call per layer over packed expert weights,
paged attention reading the KV cache in place through block tables (the whole attention half of a
layer in one call), a linear kernel over packed weights (the LM head takes its greedy argmax there,
writing no logits), RMS norm with the residual add, RoPE with the KV-cache write.

Built once per machine (``python -m afdserve.backends.cpu.build``; ``build.py``) for AVX-512 (with
AVX512-BF16 for bfloat16 GEMMs) or AVX2 with FMA and F16C. ``supports(kernel, dtype)`` says what
runs here; ``afdserve.backends.choose`` takes these backends only where everything they call does.
"""

from __future__ import annotations

import torch

from afdserve.backends.cpu.build import DTYPES, KERNELS, load
from afdserve.config import cpuinfo


def available() -> bool:
    return load().ok


def unavailable_reason() -> str:
    return load().reason


def isa() -> str:
    """The vector instructions the kernels were built for here: "avx512+bf16", "avx512", "avx2" or
    "none" (unavailable)."""
    if not load().ok:
        return "none"
    flags = set(cpuinfo("flags").split())
    if "avx512f" in flags:
        return "avx512+bf16" if "avx512_bf16" in flags else "avx512"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else "none"


def supports(kernel: str, dtype: torch.dtype) -> bool:
    """Whether ``kernel`` runs for ``dtype`` on this CPU (kernels built and loaded)."""
    if not load().ok:
        return False
    if not _supported:
        _supported.update({(k, dt): bool(torch.ops.afdserve_kernels.supported(k, dt)) for k in KERNELS for dt in DTYPES})
    return _supported.get((kernel, dtype), False)


_supported: dict[tuple[str, torch.dtype], bool] = {}
