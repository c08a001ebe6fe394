"""How a decode step's whole forward over fixed buffers is captured once per padded batch size and
run again (``afdserve.engine.padded``), chosen once when the engine is built (``choose_capture``):

* ``CudaGraphs``: a ``torch.cuda.CUDAGraph`` per function, warmed up on a side stream and captured
  into one memory pool shared by every graph (the largest batch first, so the smaller reuse it);
  a run is a replay, and the function's outputs are the graph's fixed output tensors.
* ``Compiled``: ``torch.compile(fullgraph=True, dynamic=False)`` per function: what the CPU runs to
  check that the forward a graph would capture has no graph break and no shape or value read back
  to the host (the Triton kernels are custom ops, interpreted on CPU tensors). On CUDA with
  ``compile=True`` the compiled function is what the graph captures.

Only backends whose step reads nothing from the host can be captured (``capture_blocker``): the
triton attention backend (its context is fixed buffers: block tables, lengths) with the torch MoE
backend (no host sync: on CUDA, ``torch._grouped_mm``'s bfloat16 kernels of sm9x / sm10x; its other
cases loop over the groups on the host, reading the offsets back), the KV cache in the model's dtype."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from afdserve.backends import Backends

Fn = Callable[[], torch.Tensor]


class Capture(Protocol):
    name: str

    def capture(self, fn: Fn) -> Fn:
        """``fn`` (no arguments: it reads fixed buffers) made into what runs it again: calls of the
        result compute what ``fn`` would on the buffers' values at that time."""
        ...


class Compiled:
    name = "compile"

    def __init__(self, functions: int):
        # dynamo keeps a compiled graph per (function, specialization): one per captured function here
        self.limit = max(8, functions + 1)

    def capture(self, fn: Fn) -> Fn:
        compiled = torch.compile(fn, fullgraph=True, dynamic=False)
        cfg = torch._dynamo.config
        name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"

        def run() -> torch.Tensor:
            with cfg.patch(**{name: self.limit}):
                return compiled()

        return run


class CudaGraphs:
    name = "cuda_graphs"

    def __init__(self, device: torch.device, inner: Compiled | None = None):
        self.device, self.inner = device, inner
        self.pool = None  # one memory pool for every graph (``torch.cuda.graph_pool_handle``)
        self.stream = torch.cuda.Stream(device)

    def capture(self, fn: Fn) -> Fn:
        if self.inner is not None:
            fn = self.inner.capture(fn)
        # warm-up on a side stream (lazy initializations, compilation, the allocator's first blocks)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


def capture_blocker(backends: Backends, fp8_kv: bool, device: torch.device, dtype: torch.dtype) -> str:
    """Why a decode step over ``backends`` in ``dtype`` on ``device`` cannot be captured ("" where it can)."""
    if backends.attention.name != "triton":
        return (f"the {backends.attention.name} attention backend builds its context on the host each step "
                "(the triton one reads fixed buffers)")
    if backends.moe.name != "torch":
        return f"the {backends.moe.name} MoE backend (the torch one runs without host syncs)"
    if fp8_kv:
        return "an FP8 KV cache (its writes are not captured in this version)"
    if device.type == "cuda" and (dtype != torch.bfloat16 or not _grouped_mm_kernels(device)):
        return (f"torch._grouped_mm in {dtype} on this GPU reads its group offsets back to the host (its "
                "kernels without: bfloat16 on sm9x / sm10x)")
    return ""


def _grouped_mm_kernels(device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` has its bfloat16 kernels on ``device``: compute capability 9.x or
    10.x, as torch decides (``_scaled_mm_allowed_device(sm90_only, sm100_only)``)."""
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def choose_capture(device: torch.device, backends: Backends, *, eager: bool, compile: bool, fp8_kv: bool,
                   dtype: torch.dtype, functions: int) -> Capture | None:
    """How the colocated engine's decode steps are captured (None: they run eager): CUDA graphs on a
    CUDA device unless ``eager`` (of the compiled forward with ``compile``); on the CPU, compiled
    whole with ``compile``; nothing where ``capture_blocker`` says why not. ``functions``: how many
    functions will be captured (one per padded batch size and variant)."""
    if eager or capture_blocker(backends, fp8_kv, device, dtype):
        return None
    if device.type == "cuda":
        return CudaGraphs(device, Compiled(functions) if compile else None)
    return Compiled(functions) if compile else None
