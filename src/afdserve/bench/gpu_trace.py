"""What a ``torch.profiler`` trace of some decode steps says of the GPU: busy time, kernels, launches
and host syncs per step (``afdserve bench gpu``).

The trace is the profiler's Chrome trace (``export_chrome_trace``: Kineto's categories, times in
microseconds). The GPU is busy where any kernel, memcpy or memset runs: the union of their intervals
(streams may overlap). A launch is a host call that queues GPU work: a kernel launch (runtime or
driver API: triton's kernels go through the driver) or a CUDA graph launch, which queues every
kernel of its graph at once. A host sync is
a call that blocks the host until the GPU is done: a stream, device or event synchronize, or a
synchronous ``cudaMemcpy`` (a ``.item()`` / ``.tolist()`` of a GPU tensor is an async copy and a
stream synchronize: counted once).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from afdserve.runtime.trace_plot import union_length

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_API_CATEGORIES = ("cuda_runtime", "cuda_driver")
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                        "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2",
                        "cuMemcpyDtoH"})
LAUNCH_MARKS = ("LaunchKernel", "LaunchCooperativeKernel", "GraphLaunch")  # runtime and driver API
STEP_MARK = "afdserve_decode_step"  # the profiled steps' record_function: host calls outside them are not counted


@dataclass(frozen=True)
class StepTrace:
    """Per decode step, over the traced steps."""

    steps: int
    gpu_busy_ms: float  # union of kernel, memcpy and memset intervals
    kernels: float
    launches: float
    syncs: float
    launch_calls: dict[str, int] = field(default_factory=dict)  # over all the traced steps, by name
    sync_calls: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"steps": self.steps, "gpu_busy_ms_per_step": self.gpu_busy_ms, "kernels_per_step": self.kernels,
                "launches_per_step": self.launches, "host_syncs_per_step": self.syncs,
                "launch_calls": self.launch_calls, "sync_calls": self.sync_calls}


def _count(names: list[str], keep: Callable[[str], bool]) -> dict[str, int]:
    out: dict[str, int] = {}
    for name in names:
        if keep(name):
            out[name] = out.get(name, 0) + 1
    return out


def analyze(events: list[dict], steps: int) -> StepTrace | None:
    """The per-step figures of ``steps`` decode steps traced in ``events`` (a Chrome trace's
    ``traceEvents``); host calls count only inside the steps' ``STEP_MARK`` spans where the trace has
    them (the profiler's own start and stop calls stay out). None where the trace holds no GPU
    activity (a CPU run, or a profiler that recorded none)."""
    spans = [e for e in events if e.get("ph") == "X" and "ts" in e]
    gpu = [e for e in spans if e.get("cat") in GPU_CATEGORIES]
    if not gpu or steps < 1:
        return None
    marks = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in spans
             if e.get("name") == STEP_MARK and e.get("cat") == "user_annotation"]
    inside = (lambda t: any(a <= t <= b for a, b in marks)) if marks else (lambda t: True)
    api = [e["name"] for e in spans if e.get("cat") in HOST_API_CATEGORIES and inside(float(e["ts"]))]
    busy = union_length([(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in gpu])
    launches = _count(api, lambda n: any(m in n for m in LAUNCH_MARKS))
    syncs = _count(api, lambda n: n in SYNC_CALLS)
    return StepTrace(steps=steps, gpu_busy_ms=busy / 1e3 / steps,
                     kernels=sum(e.get("cat") == "kernel" for e in gpu) / steps,
                     launches=sum(launches.values()) / steps, syncs=sum(syncs.values()) / steps,
                     launch_calls=launches, sync_calls=syncs)


def analyze_profile(prof: object, steps: int, scratch: Path) -> StepTrace | None:
    """``analyze`` of a finished ``torch.profiler.profile``'s trace (written to ``scratch`` and read back)."""
    path = scratch / "decode_trace.json"
    prof.export_chrome_trace(str(path))  # type: ignore[attr-defined]
    try:
        raw = json.loads(path.read_text())
    finally:
        path.unlink(missing_ok=True)
    return analyze(raw.get("traceEvents", []) if isinstance(raw, dict) else raw, steps)
