"""CPU kernels of the decode hot path (C++, built once per machine: ``afdserve.kernels.build``).

* ``fused_moe``: every routed (token, expert) pair of a MoE layer in one call over weights packed
  once (``moe.pack_gate_up``, ``moe.pack_down``), no loop over experts, no gathered token copies;
* ``paged_attention``: decodes and prefills of a step in one call, reading the paged KV cache in
  place through block tables;
* ``linear`` (packed weights), ``rms_norm``, ``rope_cache`` (with the KV cache write), and
  ``attention_half``: all of a layer's attention half in one call.

``supports(kernel, tensor)`` says whether a kernel runs for that tensor (on the CPU, a dtype the
build supports, kernels built and loaded); callers keep their PyTorch path for everything else.
"""

from __future__ import annotations

import torch

from afdserve.kernels.build import DTYPES, KERNELS, load


def available() -> bool:
    return load().ok


def isa() -> str:
    """The vector instructions the kernels were built for here: "avx512+bf16", "avx512", "avx2" or
    "none" (unavailable: the PyTorch paths serve)."""
    from afdserve.kernels.build import cpuinfo

    if not load().ok:
        return "none"
    flags = set(cpuinfo("flags").split())
    if "avx512f" in flags:
        return "avx512+bf16" if "avx512_bf16" in flags else "avx512"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else "none"


def ops():
    """``torch.ops.afdserve_kernels`` (loaded); RuntimeError naming the reason if unavailable."""
    state = load()
    if not state.ok:
        raise RuntimeError(f"afdserve kernels unavailable: {state.reason}")
    return torch.ops.afdserve_kernels


def supports(kernel: str, x: torch.Tensor) -> bool:
    """Whether ``kernel`` runs for ``x``'s device and dtype here. The answers for every kernel and
    dtype are asked once, together, so that code ``torch.compile`` traces only reads a table."""
    if x.device.type != "cpu" or not load().ok:
        return False
    if not _supported:
        _supported.update({(k, dt): bool(torch.ops.afdserve_kernels.supported(k, dt)) for k in KERNELS for dt in DTYPES})
    return _supported.get((kernel, x.dtype), False)


_supported: dict[tuple[str, torch.dtype], bool] = {}


def borrow_lent_threads(board: torch.Tensor | None, most: int) -> bool:
    """Lets this process's big kernels (fused MoE, large linears) borrow, chunk by chunk, up to
    ``most`` threads that idle processes lend on ``board`` (int32 [2, slots] over shared memory:
    ``afdserve.runtime.core_board``); None stops it. False when the kernels are unavailable."""
    if not load().ok:
        return False
    ops().lend_board(torch.empty(0, dtype=torch.int32) if board is None else board, most if board is not None else 0)
    return True


def lent_threads_now() -> int:
    """The threads a big kernel of this process would borrow now (0 without a board)."""
    return int(ops().lent_threads_now()) if load().ok else 0


def lent_chunks() -> int:
    """Chunks of work this process's borrowed threads have run so far (diagnostics and tests)."""
    return int(ops().lent_chunks()) if load().ok else 0
