"""Soak test of the HTTP server: many concurrent streaming clients for minutes against a live
``afdserve serve`` (the demo model, disaggregated, by default), some hanging up mid-stream.

It starts the server as a subprocess, runs the load, then checks that every request completed,
was cancelled by its client or got a clean OpenAI-shaped error; that KV-cache usage and in-flight
requests return to zero; that /dev/shm holds only the live deployment's segments; and that after
SIGINT the server and all its workers exit and leave no segment behind.

    python benchmarks/soak.py [--clients 64] [--duration 120] [--input-len 128] [--output-len 64]
                              [--cancel-fraction 0.1] [--json out/soak.json] [-- SERVE ARGS...]

Arguments after ``--`` go to ``afdserve serve`` (default: its defaults, i.e. the demo model on
1 attention + 1 expert worker with 2 micro-batches).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main() -> int:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--cancel-fraction", type=float, default=0.1, help="share of clients that hang up mid-stream")
    ap.add_argument("--slo-tbt-ms", type=float, default=100.0)
    ap.add_argument("--tokenizer", default=None, help="the served model's folder (default: the demo model)")
    ap.add_argument("--json", default="out/soak.json")
    args = ap.parse_args(argv)

    from afdserve.bench.serve_report import format_table
    from afdserve.bench.soak import run_soak, scrape, stray_segments
    from afdserve.bench.workload import synthetic_requests, vocab_size
    from afdserve.engine.builder import resolve_model
    from afdserve.engine.tokenizer import load_tokenizer

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    log_path = os.path.splitext(args.json)[0] + ".server.log"
    cmd = [sys.executable, "-m", "afdserve.cli.main", "serve", "--port", str(port), "--log-level", "warning",
           *serve_args]
    print("server:", " ".join(cmd[2:]), f"(log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start (see {log_path})")
            time.sleep(0.5)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        deployment = {server.pid} | _descendants(server.pid)
        print(f"deployment processes: {sorted(deployment)}", flush=True)
        path = resolve_model(args.tokenizer)
        reqs = synthetic_requests(args.clients * 4, args.input_len, args.output_len,
                                  vocab_size(path, load_tokenizer(path).tokenizer))
        from tqdm import tqdm

        bar = tqdm(unit="req", desc=f"soak {args.clients} clients x {args.duration:g} s", file=sys.stderr)
        t0 = time.monotonic()
        report = run_soak(url, model, reqs, clients=args.clients, duration_s=args.duration,
                          live_pids=lambda: {server.pid} | _descendants(server.pid),
                          cancel_fraction=args.cancel_fraction, slo_tbt_ms=args.slo_tbt_ms,
                          on_done=lambda r: bar.update(1))
        bar.close()
        wall = time.monotonic() - t0
        metrics = scrape(url)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            code = server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
            code = server.wait()
    time.sleep(1.0)
    left_alive = sorted(p for p in deployment if _alive(p))
    left_segments = stray_segments(set())
    problems = report.problems
    if code not in (0, 130):  # 130: uvicorn re-raises the SIGINT after its graceful shutdown
        problems.append(f"the server exited with code {code}")
    if left_alive:
        problems.append(f"processes still alive after shutdown: {left_alive}")
    if left_segments:
        problems.append(f"shared-memory segments left after shutdown: {left_segments}")
    print(format_table(report.summary))
    print(f"load + drain wall time: {wall:.1f} s; KV usage back to zero {report.drained_s:.1f} s after the load"
          if report.drained_s is not None else "KV usage did NOT return to zero")
    print(f"after the load: KV usage {report.kv_usage_after}, in flight {report.in_flight_after}; "
          f"stray segments while serving: {report.stray_segments}; after shutdown: {left_segments}; "
          f"server exit code {code}")
    print("PASS" if not problems else "FAIL:\n  " + "\n  ".join(problems))
    busy = {k: v for k, v in metrics.items() if k.startswith("afdserve_worker_busy_seconds_total")}
    with open(args.json, "w") as f:
        json.dump({"config": vars(args) | {"serve_args": serve_args}, "summary": report.summary,
                   "unclean": report.unclean, "drained_s": report.drained_s, "kv_usage_after": report.kv_usage_after,
                   "stray_segments": report.stray_segments, "segments_after_shutdown": left_segments,
                   "server_exit_code": code, "worker_busy_seconds": busy, "problems": problems}, f, indent=1,
                  default=str)
    print(f"wrote {args.json}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
