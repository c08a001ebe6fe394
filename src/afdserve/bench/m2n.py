"""``afdserve bench m2n``: M2N latency and throughput per transport (MegaScale-Infer Figs. 11/12).

Sweep 1: message sizes at fixed M (senders) and N (receivers). Sweep 2: M = N varied at one size.
Every transport (and plain torch.distributed point-to-point, ``torch_raw``) runs the same protocol
in the same run, next to this machine's memcpy bandwidth. Size = bytes from one sender to one
receiver. Throughput is in GB/s (10^9 bytes/s) summed over all pairs. "cpu shared" is the share of
latency iterations after which a sender and a receiver were on the same CPU (then they time-share
one core: on a machine with other load, placement decides the latency regime).

    afdserve bench m2n --transports shm,tcp,torch,torch_raw --sizes 2KiB,256KiB,8MiB \
        --senders 1 --receivers 1 --iters 500 --json out.json --plot out.png
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import secrets
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from afdserve.bench.m2n_report import fmt_size, format_table, plot
from afdserve.comm.memcpy import memcpy_gbps

ALL_TRANSPORTS = ("shm", "tcp", "torch", "torch_raw")
DEFAULT_SIZES = (2 << 10, 8 << 10, 32 << 10, 128 << 10, 256 << 10, 512 << 10, 2 << 20, 8 << 20)


@dataclass(frozen=True)
class M2NOptions:
    """One run of the M2N benchmark (the flags of ``afdserve bench m2n``)."""

    transports: Sequence[str] = ALL_TRANSPORTS  # of ALL_TRANSPORTS (torch_raw: plain gloo send/recv, no metadata)
    sizes: Sequence[int] = DEFAULT_SIZES  # bytes per sender->receiver message
    senders: int = 1  # M for the size sweep
    receivers: int = 1  # N for the size sweep
    scale: Sequence[int] = field(default=(1, 2, 4))  # M=N values of the scaling sweep (empty: skip it)
    scale_size: int = 256 << 10  # message size of the scaling sweep
    iters: int = 500  # timed latency iterations per point
    slots: int = 4  # registered slots per pair
    spin_us: float = 100.0  # busy-poll time before blocking (CommConfig.spin_s)
    pin: bool = False  # pin worker processes to CPUs round-robin (all transports alike)
    json_path: str | None = None  # write results here
    plot_path: str | None = None  # save a PNG of the results here


def memcpy_row(size: int, iters: int, slots: int) -> dict:
    """Copy ``size`` bytes from one buffer into rotating slots (what a shm send does, minus protocol)."""
    src = np.random.randint(0, 255, size, dtype=np.uint8)
    dst = np.empty((slots, max(size, 1)), dtype=np.uint8)
    lat = np.empty(iters)
    for i in range(iters + 20):
        t = time.perf_counter_ns()
        np.copyto(dst[i % slots, :size], src)
        if i >= 20:
            lat[i - 20] = time.perf_counter_ns() - t
    med = float(np.median(lat)) / 1e3
    t = time.perf_counter_ns()
    n = max(20, min(iters, (512 << 20) // max(size, 1)))
    for i in range(n):
        np.copyto(dst[i % slots, :size], src)
    el = (time.perf_counter_ns() - t) / 1e9
    return {"transport": "memcpy", "senders": 1, "receivers": 1, "size_bytes": size, "median_us": med,
            "p99_us": float(np.percentile(lat, 99)) / 1e3, "throughput_gbps": n * size / el / 1e9}


def _stream_count(size: int, iters: int) -> int:
    return int(max(16, min(iters, (256 << 20) // max(size, 1))))


def run_point(transport: str, m: int, n: int, sizes: Sequence[int], iters: int, slots: int,
              spin_s: float, pin: bool = False, timeout_s: float = 900.0) -> list[dict]:
    """Start M senders + N receivers (spawn), measure every size, return result rows."""
    import torch.distributed as dist

    from afdserve.bench.m2n_worker import WorkerSpec, run

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    ready = [ctx.Semaphore(0) for _ in range(m)]
    barrier = ctx.Barrier(m + n)
    results = ctx.Queue()
    warmup = max(10, iters // 10)
    stream = tuple(_stream_count(s, iters) for s in sizes)
    group = f"bench-{transport}-{m}x{n}-{secrets.token_hex(4)}"
    procs = []
    cpus = sorted(os.sched_getaffinity(0))
    for role, count in (("recv", n), ("send", m)):
        for i in range(count):
            cpu = cpus[len(procs) % len(cpus)] if pin else -1
            spec = WorkerSpec(role, i, transport, m, n, tuple(sizes), iters, warmup, stream, store.host,
                              store.port, group, slots, spin_s, cpu)
            p = ctx.Process(target=run, args=(spec, ready, barrier, results), daemon=True)
            p.start()
            procs.append(p)
    got: dict[tuple[str, int], dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < m + n:
            rem = deadline - time.monotonic()
            if rem <= 0:
                raise TimeoutError(f"{transport} {m}x{n}: workers did not finish in {timeout_s:.0f} s")
            try:
                role, idx, out = results.get(timeout=min(rem, 5.0))
            except Exception:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{transport} {m}x{n}: a worker died (exit code {dead[0].exitcode})")
                continue
            if "error" in out:
                raise RuntimeError(f"{transport} {m}x{n} {role}{idx} failed:\n{out['error']}")
            got[(role, idx)] = out
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    rows = []
    used = sorted({t for o in got.values() for t in o.get("transports", [])})
    label = transport if transport == "torch_raw" else "/".join(used) or transport
    for size in sizes:
        starts = np.min(np.stack([got[("send", i)]["lat"][size] for i in range(m)]), axis=0)
        ends = np.max(np.stack([got[("recv", j)]["lat"][size] for j in range(n)]), axis=0)
        lat_us = (ends - starts) / 1e3
        t0 = min(o["tput"][size][0] for k, o in got.items() if k[0] == "send")
        t1 = max(o["tput"][size][1] for k, o in got.items() if k[0] == "recv")
        nbytes = m * n * size * _stream_count(size, iters)
        s_cpu = np.stack([got[("send", i)]["cpu"][size] for i in range(m)])
        r_cpu = np.stack([got[("recv", j)]["cpu"][size] for j in range(n)])
        shared = np.mean([bool(set(s_cpu[:, i]) & set(r_cpu[:, i])) for i in range(s_cpu.shape[1])])
        rows.append({"transport": label, "senders": m, "receivers": n, "size_bytes": int(size),
                     "median_us": float(np.median(lat_us)), "p99_us": float(np.percentile(lat_us, 99)),
                     "throughput_gbps": nbytes / ((t1 - t0) / 1e9) / 1e9, "cpu_shared": float(shared)})
    return rows


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"memcpy_gbps": memcpy_gbps(), "cpu": cpu, "cores": os.cpu_count(), "loadavg_at_start": os.getloadavg(),
            "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "units": {"latency": "microseconds", "throughput_gbps": "GB/s = 1e9 bytes/s, summed over all pairs",
                      "cpu_shared": "share of latency iterations after which a sender and a receiver ran on one CPU",
                      "memcpy_gbps": "GB/s, one core copying a 256 MiB buffer"}}


def run_m2n(opts: M2NOptions) -> dict:
    """Runs both sweeps; prints the table, writes the JSON and the plot; returns the report."""
    sizes = sorted(set(opts.sizes))
    report = {"machine": machine_info(), "results": [],
              "config": {"iters": opts.iters, "slots": opts.slots, "spin_us": opts.spin_us, "pin": opts.pin,
                         "sizes_at": [opts.senders, opts.receivers], "scale": opts.scale,
                         "scale_size": opts.scale_size}}
    rows = report["results"]
    for size in sorted(set(sizes) | ({opts.scale_size} if opts.scale else set())):
        rows.append(memcpy_row(size, opts.iters, opts.slots))
    spin = opts.spin_us * 1e-6
    for t in opts.transports:
        print(f"[m2n] {t}: M={opts.senders} N={opts.receivers} sizes {','.join(fmt_size(s) for s in sizes)}",
              flush=True)
        rows += run_point(t, opts.senders, opts.receivers, sizes, opts.iters, opts.slots, spin, opts.pin)
        for k in opts.scale:
            if k == opts.senders == opts.receivers and opts.scale_size in sizes:
                continue
            print(f"[m2n] {t}: M=N={k} size {fmt_size(opts.scale_size)}", flush=True)
            rows += run_point(t, k, k, [opts.scale_size], opts.iters, opts.slots, spin, opts.pin)
    report["machine"]["loadavg_at_end"] = os.getloadavg()
    print(f"memcpy (one core, 256 MiB): {report['machine']['memcpy_gbps']:.2f} GB/s; load average "
          f"{report['machine']['loadavg_at_start'][0]:.2f} -> {report['machine']['loadavg_at_end'][0]:.2f}")
    print(format_table(rows))
    if opts.json_path:
        with open(opts.json_path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {opts.json_path}")
    if opts.plot_path:
        plot(report, opts.plot_path, opts.senders, opts.receivers, opts.scale_size)
        print(f"wrote {opts.plot_path}")
    return report
