"""``afdserve bench m2n``: M2N latency and throughput per transport (MegaScale-Infer Figs. 11/12).

Sweep 1: message sizes at fixed M (senders) and N (receivers). Sweep 2: M = N varied at one size.
Every transport (and plain torch.distributed point-to-point, ``torch_raw``) runs the same protocol
in the same run, next to this machine's memcpy bandwidth. Size = bytes from one sender to one
receiver. Throughput is in GB/s (10^9 bytes/s) summed over all pairs. "cpu shared" is the share of
latency iterations after which a sender and a receiver were on the same CPU (then they time-share
one core: on a machine with other load, placement decides the latency regime).

    python -m afdserve.comm.bench --transports shm,tcp,torch,torch_raw --sizes 2KiB,256KiB,8MiB \
        --senders 1 --receivers 1 --iters 500 --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import secrets
import sys
import time
from typing import Sequence

import numpy as np
import torch

ALL_TRANSPORTS = ("shm", "tcp", "torch", "torch_raw")
DEFAULT_SIZES = "2KiB,8KiB,32KiB,128KiB,256KiB,512KiB,2MiB,8MiB"
_UNITS = {"": 1, "b": 1, "kb": 1000, "kib": 1024, "k": 1024, "mb": 1000**2, "mib": 1024**2, "m": 1024**2,
          "gb": 1000**3, "gib": 1024**3, "g": 1024**3}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 2KiB, 256KiB, 8MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_size(n: int) -> str:
    for unit, f in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return f"{n}B"


def _csv(conv):
    def parse(text: str) -> list:
        return [conv(x) for x in text.split(",") if x.strip()]
    return parse


def _transports(text: str) -> list[str]:
    out = _csv(str.strip)(text)
    bad = [t for t in out if t not in ALL_TRANSPORTS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown transport(s) {bad}; use {','.join(ALL_TRANSPORTS)}")
    return out


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transports", type=_transports, default=list(ALL_TRANSPORTS),
                   help="comma list of shm,tcp,torch,torch_raw (torch_raw: plain gloo send/recv, no metadata)")
    p.add_argument("--sizes", type=_csv(parse_size), default=_csv(parse_size)(DEFAULT_SIZES),
                   help=f"bytes per sender->receiver message (default {DEFAULT_SIZES})")
    p.add_argument("--senders", type=int, default=1, help="M for the size sweep")
    p.add_argument("--receivers", type=int, default=1, help="N for the size sweep")
    p.add_argument("--scale", type=_csv(int), default=[1, 2, 4],
                   help="M=N values of the scaling sweep (empty string to skip)")
    p.add_argument("--scale-size", type=parse_size, default=256 << 10, help="message size of the scaling sweep")
    p.add_argument("--iters", type=int, default=500, help="timed latency iterations per point")
    p.add_argument("--slots", type=int, default=4, help="registered slots per pair")
    p.add_argument("--spin-us", type=float, default=100.0, help="busy-poll time before blocking (CommConfig.spin_s)")
    p.add_argument("--pin", action="store_true",
                   help="pin worker processes to CPUs round-robin (all transports alike)")
    p.add_argument("--json", dest="json_path", default=None, help="write results here")
    p.add_argument("--plot", dest="plot_path", default=None, help="save a PNG of the results here")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``m2n`` on the ``afdserve bench`` sub-command's subparsers."""
    p = subparsers.add_parser("m2n", help="M2N communication micro-benchmark (latency, throughput)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    p.set_defaults(func=main)
    return p


# -- measurements ------------------------------------------------------------------------------------

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

    from afdserve.comm.bench_worker import WorkerSpec, run

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


# -- reporting ---------------------------------------------------------------------------------------

def format_table(rows: Sequence[dict]) -> str:
    head = (f"{'transport':<10} {'M':>2} {'N':>2} {'size':>7} {'median us':>10} {'p99 us':>10} {'GB/s':>8} "
            f"{'cpu shared':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        shared = f"{100 * r['cpu_shared']:.0f}%" if "cpu_shared" in r else "-"
        lines.append(f"{r['transport']:<10} {r['senders']:>2} {r['receivers']:>2} {fmt_size(r['size_bytes']):>7} "
                     f"{r['median_us']:>10.1f} {r['p99_us']:>10.1f} {r['throughput_gbps']:>8.2f} {shared:>10}")
    return "\n".join(lines)


def plot(report: dict, path: str, m: int, n: int, scale_size: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    names = [t for t in dict.fromkeys(r["transport"] for r in rows) if t != "memcpy"]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    metrics = (("median_us", "median latency (us)"), ("p99_us", "p99 latency (us)"),
               ("throughput_gbps", "throughput (GB/s)"))
    for col, (key, label) in enumerate(metrics):
        ax = axes[0][col]
        for t in names + ["memcpy"]:
            pts = sorted((r["size_bytes"], r[key]) for r in rows
                         if r["transport"] == t and r["senders"] == m and r["receivers"] == n)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "--" if t == "memcpy" else "-o", label=t)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"message size (bytes), M={m} N={n}")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax = axes[1][col]
        for t in names:
            pts = sorted((r["senders"], r[key]) for r in rows
                         if r["transport"] == t and r["size_bytes"] == scale_size and r["senders"] == r["receivers"])
            if len(pts) > 1:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=t)
        ax.set_xlabel(f"M = N (message {fmt_size(scale_size)})")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    for ax in (axes[0][0], axes[1][0]):
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    mach = report["machine"]
    fig.suptitle(f"afdserve M2N — {mach['cpu']}, {mach['cores']} cores, memcpy {mach['memcpy_gbps']:.1f} GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    if args.senders < 1 or args.receivers < 1 or args.iters < 1:
        print("error: --senders, --receivers and --iters must be >= 1", file=sys.stderr)
        return 2
    sizes = sorted(set(args.sizes))
    report = {"machine": machine_info(), "results": [],
              "config": {"iters": args.iters, "slots": args.slots, "spin_us": args.spin_us, "pin": args.pin,
                         "sizes_at": [args.senders, args.receivers], "scale": args.scale,
                         "scale_size": args.scale_size}}
    rows = report["results"]
    for size in sorted(set(sizes) | ({args.scale_size} if args.scale else set())):
        rows.append(memcpy_row(size, args.iters, args.slots))
    spin = args.spin_us * 1e-6
    for t in args.transports:
        print(f"[m2n] {t}: M={args.senders} N={args.receivers} sizes {','.join(fmt_size(s) for s in sizes)}",
              flush=True)
        rows += run_point(t, args.senders, args.receivers, sizes, args.iters, args.slots, spin, args.pin)
        for k in args.scale:
            if k == args.senders == args.receivers and args.scale_size in sizes:
                continue
            print(f"[m2n] {t}: M=N={k} size {fmt_size(args.scale_size)}", flush=True)
            rows += run_point(t, k, k, [args.scale_size], args.iters, args.slots, spin, args.pin)
    report["machine"]["loadavg_at_end"] = os.getloadavg()
    print(f"memcpy (one core, 256 MiB): {report['machine']['memcpy_gbps']:.2f} GB/s; load average "
          f"{report['machine']['loadavg_at_start'][0]:.2f} -> {report['machine']['loadavg_at_end'][0]:.2f}")
    print(format_table(rows))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json_path}")
    if args.plot_path:
        plot(report, args.plot_path, args.senders, args.receivers, args.scale_size)
        print(f"wrote {args.plot_path}")
    return 0


def _standalone() -> int:
    p = argparse.ArgumentParser(prog="python -m afdserve.comm.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    return main(p.parse_args())


if __name__ == "__main__":
    sys.exit(_standalone())
