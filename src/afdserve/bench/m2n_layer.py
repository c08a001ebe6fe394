"""``afdserve bench m2n --layer``: one MoE layer's dispatch + combine between M attention and N
expert processes, as the runtime does it, per transport in the same run.

Each attention process routes ``tokens`` tokens top-k over ``experts`` experts (uniformly at random,
seeded), plans the dispatch on its device (``runtime/dispatch.py``: fixed-capacity slots, no host
read), sends each expert process its slot (hidden states, ids, weights) and adds the replies into
the layer's output. Expert processes answer each message with its hidden states as the partial
sums (no expert math: the figure is the data path alone). Latency: one layer's round trip on an
attention process, from the plan to the combined output (synchronised with the device), median and
p99 over the iterations of every attention process. Throughput: layers per second over all
attention processes together, and the bytes they moved (dispatch and combine) per second.

    afdserve bench m2n --layer [--transports shm,tcp,torch,cuda_ipc] [--scale 1,2] [--tokens 256] [--hidden 2048]
        [--experts 128] [--top-k 8] [--dtype bfloat16] [--device cpu|cuda] [--iters 200] [--json PATH]
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import secrets
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import torch

LAYER_TRANSPORTS = ("shm", "tcp", "torch", "cuda_ipc")  # cuda_ipc: only with the tensors on a CUDA device


@dataclass(frozen=True)
class LayerOptions:
    transports: Sequence[str] = ("shm", "tcp", "torch")
    scale: Sequence[int] = (1, 2)  # M = N values
    tokens: int = 256  # per attention process and layer
    hidden: int = 2048
    experts: int = 128
    top_k: int = 8
    dtype: str = "bfloat16"
    device: str = "cpu"  # where the tensors live ("cuda": the torch transport runs NCCL, cuda_ipc can run)
    iters: int = 200
    json_path: str | None = None


@dataclass(frozen=True)
class _Spec:
    role: str  # "attention" | "expert"
    index: int
    m: int
    n: int
    transport: str
    store: tuple[str, int]
    group: str
    opts: LayerOptions


def slot_bytes(o: LayerOptions) -> int:
    return o.tokens * (o.hidden * torch.finfo(getattr(torch, o.dtype)).bits // 8 + o.top_k * 8) + 4 * 64


def _comm(spec: _Spec):
    import torch.distributed as dist

    from afdserve.comm import CommConfig, Communicator

    store = dist.TCPStore(spec.store[0], spec.store[1], is_master=False, timeout=datetime.timedelta(seconds=120))
    o = spec.opts
    cfg = CommConfig(transport=spec.transport, slot_bytes=slot_bytes(o), num_slots=4, deadline_s=60.0,
                     connect_timeout_s=120.0, device=o.device)
    me = f"{spec.role[0]}{spec.index}"
    comm = Communicator(me, store, cfg, group=spec.group)
    peers = [f"e{j}" for j in range(spec.n)] if spec.role == "attention" else [f"a{i}" for i in range(spec.m)]
    comm.connect(send_to=peers, recv_from=peers)
    return comm, peers


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _attention(spec: _Spec, comm, peers: list[str]) -> dict:
    from afdserve.comm import Meta
    from afdserve.runtime.dispatch import Capacity, Dispatcher
    from afdserve.runtime.expert_map import ExpertMap

    o, dev = spec.opts, torch.device(spec.opts.device)
    g = torch.Generator().manual_seed(spec.index)
    y = torch.randn(o.tokens, o.hidden, generator=g).to(dev, getattr(torch, o.dtype))
    ids = torch.rand(o.tokens, o.experts, generator=g).argsort(1)[:, : o.top_k].to(dev)
    w = torch.rand(o.tokens, o.top_k, generator=g).to(dev)
    plan = Dispatcher(ExpertMap.contiguous(1, o.experts, spec.n), o.experts, o.top_k, Capacity(), dev)
    warm = max(10, o.iters // 10)
    lat = np.zeros(o.iters)
    moved = 0
    t_first = 0
    for i in range(warm + o.iters):
        _sync(dev)
        t0 = time.perf_counter_ns()
        if i == warm:
            t_first = t0
        r = plan.plan(0, ids, w)[0][0]
        slots = y.index_select(0, r.src.reshape(-1)).view(*r.src.shape, -1)
        for j in r.to:
            comm.send(peers[j], [slots[j], r.ids[j], r.weights[j]], Meta(step=i, num_tokens=int(r.src.shape[1])))
        out = y.new_zeros(o.tokens + 1, o.hidden)
        for j in r.to:
            msg = comm.recv(peers[j])
            out.index_add_(0, r.rows[j], msg.tensors[0].to(dev, non_blocking=True))
            msg.release()
        _sync(dev)
        if i >= warm:
            lat[i - warm] = (time.perf_counter_ns() - t0) / 1e3
            moved += 2 * sum(slots[j].numel() * slots[j].element_size() for j in r.to)
    return {"lat_us": lat.tolist(), "t0": t_first, "t1": time.perf_counter_ns(), "bytes": moved,
            "transports": sorted({comm.transport(p, "send") for p in peers})}


def _expert(spec: _Spec, comm, peers: list[str]) -> dict:
    from afdserve.comm import Meta

    o = spec.opts
    for _ in range(max(10, o.iters // 10) + o.iters):
        for p in peers:
            msg = comm.recv(p)
            comm.send(p, [msg.tensors[0]], Meta(step=msg.meta.step, num_tokens=msg.meta.num_tokens))
            msg.release()
    return {}


def _run(spec: _Spec, barrier, results) -> None:
    try:
        torch.set_num_threads(1)
        comm, peers = _comm(spec)
        try:
            barrier.wait()
            out = (_attention if spec.role == "attention" else _expert)(spec, comm, peers)
            barrier.wait()  # nobody closes while others still exchange
        finally:
            comm.close()
        results.put((spec.role, spec.index, out))
    except BaseException:  # report instead of hanging the parent
        results.put((spec.role, spec.index, {"error": traceback.format_exc()}))
        barrier.abort()


def run_point(transport: str, k: int, o: LayerOptions, timeout_s: float = 900.0) -> dict:
    """M = N = ``k`` processes per role over ``transport``: one result row."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2 * k), ctx.Queue()
    group = f"layer-{transport}-{k}-{secrets.token_hex(4)}"
    procs = [ctx.Process(target=_run, args=(_Spec(role, i, k, k, transport, (store.host, store.port), group, o),
                                            barrier, results), daemon=True)
             for role in ("expert", "attention") for i in range(k)]
    for p in procs:
        p.start()
    got: dict[tuple[str, int], dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < 2 * k:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{transport} M=N={k}: workers did not finish in {timeout_s:.0f} s")
            try:
                role, idx, out = results.get(timeout=5.0)
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"{transport} M=N={k}: a worker died")
                continue
            if "error" in out:
                raise RuntimeError(f"{transport} M=N={k} {role}{idx} failed:\n{out['error']}")
            got[(role, idx)] = out
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    att = [got[("attention", i)] for i in range(k)]
    lat = np.concatenate([a["lat_us"] for a in att])
    span_s = (max(a["t1"] for a in att) - min(a["t0"] for a in att)) / 1e9
    used = sorted({t for a in att for t in a["transports"]})
    return {"transport": "/".join(used), "M": k, "N": k, "tokens": o.tokens, "hidden": o.hidden,
            "dtype": o.dtype, "device": o.device, "median_us": float(np.median(lat)),
            "p99_us": float(np.percentile(lat, 99)), "layers_per_s": k * o.iters / span_s,
            "gbps": sum(a["bytes"] for a in att) / span_s / 1e9}


def run_layer(o: LayerOptions) -> dict:
    """Every transport at every M = N, in one run; prints the table, writes the JSON."""
    rows = []
    for k in o.scale:
        for t in o.transports:
            print(f"[m2n layer] {t}: M=N={k}, {o.tokens} tokens x {o.hidden} {o.dtype} on {o.device}", flush=True)
            rows.append(run_point(t, k, o))
    print(f"{'transport':<10} {'M':>2} {'N':>2} {'median us':>10} {'p99 us':>9} {'layers/s':>9} {'GB/s':>7}")
    for r in rows:
        print(f"{r['transport']:<10} {r['M']:>2} {r['N']:>2} {r['median_us']:>10.1f} {r['p99_us']:>9.1f} "
              f"{r['layers_per_s']:>9.1f} {r['gbps']:>7.2f}")
    report = {"options": asdict(o) | {"transports": list(o.transports), "scale": list(o.scale)}, "results": rows,
              "torch": torch.__version__}
    if o.json_path:
        with open(o.json_path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {o.json_path}")
    return report
