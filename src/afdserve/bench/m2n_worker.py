"""One process of ``afdserve bench m2n`` (started with multiprocessing 'spawn').

Latency (per size, K iterations): every receiver posts "ready" on every sender's semaphore and
enters ``recv``; every sender blocks until all receivers are ready (no busy-waiting in the
harness), stamps its start, and sends one message of ``size`` bytes to every receiver. The iteration's latency is the last receiver's
completion minus the first sender's start (one host: one monotonic clock for all processes).
Throughput (per size): every sender streams T messages to every receiver with all slots in flight;
throughput = all bytes / (last completion - first start).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import time
import traceback
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

_ns = time.perf_counter_ns
try:
    _getcpu = ctypes.CDLL(None).sched_getcpu
except (OSError, AttributeError):  # pragma: no cover
    def _getcpu() -> int:
        return -1


@dataclass(frozen=True)
class WorkerSpec:
    role: str  # "send" | "recv"
    index: int
    transport: str  # shm | tcp | torch | torch_raw
    senders: int
    receivers: int
    sizes: tuple[int, ...]
    iters: int
    warmup: int
    stream: tuple[int, ...]  # messages per pair in the throughput phase, per size
    store_host: str
    store_port: int
    group: str
    num_slots: int
    spin_s: float
    cpu: int = -1  # >= 0: pin this process to that CPU (--pin)


def _wait_ready(ready, spec: WorkerSpec) -> None:
    sem = ready[spec.index]
    for _ in range(spec.receivers):
        if not sem.acquire(timeout=120):
            raise TimeoutError("receivers never became ready")


def _post_ready(ready) -> None:
    for sem in ready:
        sem.release()


def run(spec: WorkerSpec, ready, barrier, results) -> None:
    """``ready``: one semaphore per sender, released by every receiver once per iteration."""
    try:
        torch.set_num_threads(1)
        if spec.cpu >= 0:
            os.sched_setaffinity(0, {spec.cpu})
        results.put((spec.role, spec.index, _run(spec, ready, barrier)))
    except BaseException:  # report instead of hanging the parent
        results.put((spec.role, spec.index, {"error": traceback.format_exc()}))
        barrier.abort()


def _run(spec: WorkerSpec, ready, barrier) -> dict:
    store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    if spec.transport == "torch_raw":
        return _run_raw(spec, store, ready, barrier)
    from afdserve.comm import CommConfig, Communicator

    senders = [f"s{i}" for i in range(spec.senders)]
    receivers = [f"r{j}" for j in range(spec.receivers)]
    cfg = CommConfig(transport=spec.transport, slot_bytes=max(spec.sizes), num_slots=spec.num_slots,
                     deadline_s=60.0, spin_s=spec.spin_s, connect_timeout_s=120.0)
    me = (senders if spec.role == "send" else receivers)[spec.index]
    comm = Communicator(me, store, cfg, group=spec.group)
    if spec.role == "send":
        comm.connect(send_to=receivers)
    else:
        comm.connect(recv_from=senders)
    out: dict = {"lat": {}, "tput": {}}
    try:
        order = receivers[spec.index % len(receivers):] + receivers[: spec.index % len(receivers)]
        for size, n_stream in zip(spec.sizes, spec.stream):
            total = spec.warmup + spec.iters
            stamps = np.zeros(total, dtype=np.int64)
            cpus = np.zeros(total, dtype=np.int32)
            barrier.wait()
            if spec.role == "send":
                payload = torch.randint(0, 255, (size,), dtype=torch.uint8)
                for i in range(total):
                    _wait_ready(ready, spec)
                    stamps[i] = _ns()
                    for r in order:
                        comm.send(r, payload)
                    cpus[i] = _getcpu()
            else:
                for i in range(total):
                    _post_ready(ready)
                    for s in senders:
                        comm.recv(s).release()
                    stamps[i] = _ns()
                    cpus[i] = _getcpu()
            out["lat"][size] = stamps[spec.warmup:]
            out.setdefault("cpu", {})[size] = cpus[spec.warmup:]
            barrier.wait()
            if spec.role == "send":
                t0 = _ns()
                for _ in range(n_stream):
                    for r in order:
                        comm.send(r, payload)
                out["tput"][size] = (t0, _ns())
            else:
                t0 = _ns()
                for _ in range(n_stream):
                    for s in senders:
                        comm.recv(s).release()
                out["tput"][size] = (t0, _ns())
            barrier.wait()
        out["transports"] = sorted({comm.transport(p, d) for p in comm.send_peers for d in ["send"]}
                                   | {comm.transport(p, "recv") for p in comm.recv_peers})
    finally:
        barrier.wait()  # nobody closes while others still exchange
        comm.close()
    return out


def _run_raw(spec: WorkerSpec, store, ready, barrier) -> dict:
    """Plain torch.distributed (gloo) point-to-point on one group: pre-sized tensors, no metadata."""
    m, n = spec.senders, spec.receivers
    rank = spec.index if spec.role == "send" else m + spec.index
    pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{spec.group}/raw", store), rank, m + n,
                               datetime.timedelta(seconds=120))
    out: dict = {"lat": {}, "tput": {}}
    for size, n_stream in zip(spec.sizes, spec.stream):
        total = spec.warmup + spec.iters
        stamps = np.zeros(total, dtype=np.int64)
        cpus = np.zeros(total, dtype=np.int32)
        barrier.wait()
        if spec.role == "send":
            payload = torch.randint(0, 255, (size,), dtype=torch.uint8)
            order = [m + (spec.index + j) % n for j in range(n)]
            for i in range(total):
                _wait_ready(ready, spec)
                stamps[i] = _ns()
                for w in [pg.send([payload], r, 0) for r in order]:
                    w.wait()
                cpus[i] = _getcpu()
        else:
            bufs = [torch.empty(size, dtype=torch.uint8) for _ in range(m)]
            for i in range(total):
                _post_ready(ready)
                for w in [pg.recv([bufs[s]], s, 0) for s in range(m)]:
                    w.wait()
                stamps[i] = _ns()
                cpus[i] = _getcpu()
        out["lat"][size] = stamps[spec.warmup:]
        out.setdefault("cpu", {})[size] = cpus[spec.warmup:]
        barrier.wait()
        t0 = _ns()
        if spec.role == "send":
            prev: list = []
            for _ in range(n_stream):
                cur = [pg.send([payload], m + (spec.index + j) % n, 0) for j in range(n)]
                for w in prev:
                    w.wait()
                prev = cur
            for w in prev:
                w.wait()
        else:
            for _ in range(n_stream):
                for w in [pg.recv([bufs[s]], s, 0) for s in range(m)]:
                    w.wait()
        out["tput"][size] = (t0, _ns())
        barrier.wait()
    out["transports"] = ["torch_raw"]
    barrier.wait()
    return out
