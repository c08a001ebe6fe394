"""A soak run against a live server: many concurrent streaming clients for a while (some hanging
up mid-stream), then the checks that nothing leaked.

Passes when every request completed, was cancelled by its client, or got a clean OpenAI-shaped
error; the server's KV-cache usage and in-flight requests return to zero; and /dev/shm holds no
afdserve segment but the live deployment's (``stray_segments``).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from afdserve.bench.loadgen import LoadSpec, RequestResult, run_load
from afdserve.bench.serve_report import summarize
from afdserve.bench.workload import BenchRequest

SHM_DIR = "/dev/shm"
_SEGMENT = re.compile(r"^afd_(\d+)_")


def scrape(base_url: str, timeout: float = 10.0) -> dict[str, float]:
    """The server's /metrics as ``{"name{label=value,...}": value}`` (labels sorted)."""
    text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def kv_usage(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("afdserve_kv_cache_usage_ratio")}


def _parent(pid: int) -> int | None:
    """The parent of a running process (None if it is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[1])


def _ours(pid: int) -> bool:
    """Whether a running process descends from this one."""
    me, seen = os.getpid(), 0
    while pid > 1 and seen < 64:
        parent = _parent(pid)
        if parent is None:
            return False
        if parent == me:
            return True
        pid, seen = parent, seen + 1
    return False


def stray_segments(deployment_pids: set[int]) -> list[str]:
    """afdserve shared-memory segments in /dev/shm that are not the live deployment's: made by a
    process that is gone, or by one of this process's descendants outside ``deployment_pids``.
    (Segments of unrelated live processes, e.g. another deployment on this machine, don't count.)"""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        m = _SEGMENT.match(n)
        if m is None:
            continue
        pid = int(m.group(1))
        if pid not in deployment_pids and (_parent(pid) is None or _ours(pid)):
            out.append(n)
    return sorted(out)


@dataclass
class SoakReport:
    summary: dict[str, Any]
    unclean: list[str] = field(default_factory=list)  # requests that ended neither well nor with a clean error
    drained_s: float | None = None  # seconds until KV usage and in-flight requests were back to zero
    kv_usage_after: dict[str, float] = field(default_factory=dict)
    in_flight_after: float | None = None
    stray_segments: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        out = [f"unclean request: {u}" for u in self.unclean[:10]]
        if self.drained_s is None:
            out.append(f"KV cache / in-flight requests did not return to zero: {self.kv_usage_after}, "
                       f"in flight {self.in_flight_after}")
        if self.stray_segments:
            out.append(f"shared-memory segments outside the live deployment: {self.stray_segments}")
        if self.summary["completed"] == 0:
            out.append("no request completed")
        return out


def run_soak(base_url: str, model: str, requests: list[BenchRequest], clients: int, duration_s: float,
             live_pids: Callable[[], set[int]], cancel_fraction: float = 0.1, slo_tbt_ms: float = 100.0,
             drain_timeout_s: float = 30.0, seed: int = 0,
             on_done: Callable[[RequestResult], None] | None = None) -> SoakReport:
    spec = LoadSpec(base_url=base_url, model=model, max_concurrency=clients, duration_s=duration_s,
                    cancel_fraction=cancel_fraction, seed=seed, timeout_s=max(60.0, 2 * duration_s))
    results, elapsed = asyncio.run(run_load(spec, requests, on_done))
    report = SoakReport(summarize(results, elapsed, slo_tbt_ms))
    report.unclean = [r.error or "?" for r in results if not r.clean]
    deadline = time.monotonic() + drain_timeout_s
    t0 = time.monotonic()
    while True:
        m = scrape(base_url)
        report.kv_usage_after = kv_usage(m)
        report.in_flight_after = m.get("afdserve_num_requests_in_flight")
        if report.in_flight_after == 0 and report.kv_usage_after and not any(report.kv_usage_after.values()):
            report.drained_s = time.monotonic() - t0
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    report.stray_segments = stray_segments(live_pids())
    return report
