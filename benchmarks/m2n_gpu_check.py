"""Issue 46's device check, in one run on a GPU machine (``python benchmarks/m2n_gpu_check.py --json OUT``).

1. ``ipc``: does CUDA IPC work between two processes here (the machine runs in a sandbox)? A child
   process opens a parent's CUDA tensor through its IPC handle (``torch.multiprocessing``), writes
   into it and records an interprocess event; the parent waits on the event and reads the values.
2. ``tests``: the CUDA-only tests of the CUDA IPC transport (``tests/test_comm_cuda_ipc.py``, pytest):
   payloads across many messages with slot reuse, ordering on the GPU without host sync, dead peers.
   Their counts, and the names and output of any that failed, go to the JSON.
3. ``layer``: ``afdserve bench m2n --layer`` with the tensors on the device: one MoE layer's dispatch +
   combine of 256 tokens x 2048 bf16 (top-8 of 128 experts) between M attention and N expert
   processes on the one GPU, M = N = 1 and 2, shm (through host memory) and cuda_ipc (device to
   device) against the torch transport (NCCL, which may refuse two processes on one GPU: then its
   error is reported), in the same run; the issue's bar is <= 50 us for M = N = 1.

``--device cpu`` runs the ``layer`` section on the CPU (to try the script without a GPU; cuda_ipc is
then reported as not run); ``ipc`` reports that there is no CUDA and ``tests`` that its tests were
skipped. Each section's result (or its error) goes to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]


def _child(shared: torch.Tensor, handle, q) -> None:
    try:
        shared.fill_(7.0)  # the parent's memory, opened through its IPC handle
        ev = torch.cuda.Event.from_ipc_handle(shared.device, handle)
        ev.record()
        torch.cuda.synchronize()
        q.put("ok")
    except BaseException:
        q.put(traceback.format_exc())


def ipc() -> dict:
    if not torch.cuda.is_available():
        return {"works": False, "why": "no CUDA device"}
    ctx = mp.get_context("spawn")
    x = torch.zeros(1 << 20, device="cuda")
    ev = torch.cuda.Event(interprocess=True)
    ev.record()
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(x, ev.ipc_handle(), q))
    t0 = time.perf_counter()
    p.start()
    got = q.get(timeout=120)
    p.join(60)
    if got != "ok":
        return {"works": False, "why": got}
    torch.cuda.current_stream().wait_event(ev)
    ok = bool((x == 7.0).all())
    return {"works": ok, "seconds": round(time.perf_counter() - t0, 2),
            "why": None if ok else "the child's writes are not visible"}


def tests() -> dict:
    """pytest on the CUDA IPC transport's tests; per test: passed, failed (with its output) or skipped."""
    with tempfile.TemporaryDirectory() as d:
        xml = Path(d) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
               str(REPO / "tests" / "test_comm_cuda_ipc.py"), f"--junitxml={xml}"]
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        try:
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
        except subprocess.TimeoutExpired:
            return {"error": "timed out after 300 s"}
        print(run.stdout[-3000:], flush=True)
        if not xml.exists():
            return {"rc": run.returncode, "error": (run.stdout + run.stderr)[-4000:]}
        out: dict = {"rc": run.returncode, "passed": [], "failed": {}, "skipped": {}}
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = case.get("name")
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                out["failed"][name] = ((bad.get("message") or "") + "\n" + (bad.text or ""))[-3000:]
            elif case.find("skipped") is not None:
                out["skipped"][name] = case.find("skipped").get("message")
            else:
                out["passed"].append(name)
    return out


def layer(device: str, iters: int) -> dict:
    """Each transport in its own bench run, so that one that cannot run here (NCCL between two
    processes on one GPU is refused: "duplicate GPU") is reported and the others still measured."""
    rows, errors = [], {}
    for transport in ("shm", "cuda_ipc", "torch"):
        if transport == "cuda_ipc" and not device.startswith("cuda"):
            errors[transport] = "not run: its slots live on a CUDA device"
            continue
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "layer.json"
            cmd = [sys.executable, "-m", "afdserve.cli.main", "bench", "m2n", "--layer", "--device", device,
                   "--transports", transport, "--scale", "1,2", "--iters", str(iters), "--json", str(out)]
            env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
            try:
                run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
            except subprocess.TimeoutExpired:
                errors[transport] = "timed out after 200 s"
                continue
            print(run.stdout[-2000:], flush=True)
            if run.returncode:
                errors[transport] = run.stderr[-2000:]
                continue
            rows += json.loads(out.read_text())["results"]
    one = [r["median_us"] for r in rows if r["M"] == 1]
    return {"rows": rows, "errors": errors, "best_m1_us": min(one) if one else None,
            "meets_50us": bool(one) and min(one) <= 50.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="ipc,tests,layer")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    res: dict = {"torch": torch.__version__, "cuda": torch.version.cuda,
                 "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    for sec in a.sections.split(","):
        try:
            res[sec] = ipc() if sec == "ipc" else tests() if sec == "tests" else layer(a.device, a.iters)
        except BaseException:
            res[sec] = {"error": traceback.format_exc()}
        print(f"[{sec}] {json.dumps(res[sec])[:600]}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
