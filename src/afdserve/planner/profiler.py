"""``afdserve profile --out PROFILE``: measure this machine's k1..k4, Util and runtime costs.

Everything is timed with the code the runtime runs, one thread per process as the workers use:

* **attention worker** (``k1_tok``, ``k1_ctx``, ``k2``): one decode micro-batch of ``b_a``
  sequences with ``s`` tokens of context through one layer, in the order the attention worker's
  ``PipelinedRunner`` runs it: ``_combine`` of the previous layer (merge + ``post_moe``),
  ``AttentionModel.pre_moe`` over a paged ``KVCache`` (``AttnMetadata.build`` as the scheduler
  builds it; router included) and ``_dispatch`` (sends go to a loop-back link);
* **expert worker** (``k3``, ``k4``) for every number of experts a worker can hold (divisors of
  ``E``): ``ExpertCompute.run`` over ``b_e`` token-expert pairs spread over the worker's experts;
* **M2N transport** (``latency``, ``bandwidth`` => ``Util``; send / take CPU costs, wake-up
  latency): ``afdserve.comm.Communicator`` in the runtime's ``Links`` between this process and a
  second one, pinned to different cores;
* **per-step overhead** outside the layers (scheduling, embedding, sampling, detokenizing, shipping
  the outputs) and the **LM head** of a micro-batch: the real ``Engine`` driving the attention
  worker's ``PipelinedRunner``;
* **co-running**: how much an attention worker's and an expert worker's work slow down while the
  other role computes on another core (shared last-level cache and memory bandwidth).

**Caches.** In a deployment the worker processes share the last-level cache (LLC) and each streams
far more than it holds between two calls of the same layer (an expert worker reads every layer's
weights once per step, the attention worker its LM head), so a layer never finds its weights
cached.  Every timed call is therefore preceded by writing a buffer of twice the LLC's size
(``--warm`` disables this; it makes CPU timings up to 2x optimistic).

**Noise.** Compute is timed in the measuring thread's CPU time (not inflated when other processes
take turns on its core), median of ``repeats`` calls; the grid is measured ``passes`` times and
every point keeps its least median (other processes' memory traffic only ever adds time).  Round
trips are wall time: profile an idle machine.

The fitted constants are saved with :func:`afdserve.planner.profile.save_profile` and read by
``afdserve plan --profile`` and :func:`afdserve.planner.local.predict_iteration_time`.
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from afdserve.planner.profile import (
    NetworkProfile,
    Profile,
    RuntimeCosts,
    WireFormat,
    fit_affine,
    fit_attention,
    fit_expert,
    fit_network,
    save_profile,
)

__all__ = [
    "ProfileGrid",
    "DEFAULT_GRID",
    "QUICK_GRID",
    "CacheFlusher",
    "measure_attention",
    "measure_expert",
    "TransportSamples",
    "fit_runtime",
    "summary",
    "measure_transport",
    "measure_step",
    "measure_corun",
    "run_profile",
    "add_parser",
    "main",
]


# --------------------------------------------------------------------------------------------
# grid
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProfileGrid:
    """What to measure.  Sizes are clipped to what the model allows."""

    batches: tuple[int, ...] = (1, 4, 16, 32, 64)  # b_a: sequences in one decode micro-batch
    seq_lens: tuple[int, ...] = (16, 256, 1024)  # s: context tokens of every sequence
    pairs_per_expert: tuple[int, ...] = (2, 4, 8, 16, 32, 64)  # b_e / experts held
    experts_per_node: tuple[int, ...] | None = None  # default: every divisor of E
    msg_tokens: tuple[int, ...] = (1, 16, 64, 256, 1024)  # tokens per M2N message
    step_batches: tuple[int, ...] = (1, 4, 8, 16, 24, 32, 48, 64)  # sequences per engine step
    dispatch_workers: tuple[int, ...] = (1, 2, 4)  # expert workers a micro-batch is dispatched to
    repeats: int = 9  # timed calls per point and pass (median)
    passes: int = 3  # passes over the grid; a point's time is the least of its passes' medians
    transport_repeats: int = 100
    corun: bool = True  # measure how much two workers computing at once slow each other


DEFAULT_GRID = ProfileGrid()
QUICK_GRID = ProfileGrid(
    batches=(1, 8, 32),
    seq_lens=(16, 512),
    pairs_per_expert=(2, 8, 32),
    experts_per_node=None,
    msg_tokens=(1, 64, 512),
    step_batches=(1, 16, 48),
    dispatch_workers=(1, 2),
    repeats=5,
    passes=2,
    transport_repeats=40,
)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def llc_bytes() -> int:
    """Size of the largest CPU cache (sysfs; 32 MiB when unknown)."""
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in base.glob("index*"):
        try:
            text = (idx / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best or (32 << 20)


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def idle_fraction(seconds: float = 1.0) -> float:
    """Fraction of the machine's CPU time that was idle over ``seconds`` (/proc/stat; 1.0 if unknown)."""
    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)

    try:
        a = read()
        time.sleep(seconds)
        b = read()
    except (OSError, ValueError, IndexError):
        return 1.0
    return (b[0] - a[0]) / max(1, b[1] - a[1])


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class CacheFlusher:
    """Evicts the CPU caches by writing a buffer of ``factor`` x the LLC size (no-op when disabled)."""

    def __init__(self, enabled: bool = True, factor: float = 2.0):
        self.enabled = enabled
        n = int(llc_bytes() * factor) if enabled else 0
        self._buf = torch.empty(max(n // 4, 1), dtype=torch.float32)
        self._val = 0.0

    def __call__(self) -> None:
        if self.enabled:
            self._val += 1.0
            self._buf.fill_(self._val)


_cpu = time.thread_time  # CPU time of this thread: what the call costs even when other processes take turns


def _median_time(fn: Callable[[], object], repeats: int, before: Callable[[], None] | None = None) -> float:
    """Median CPU time of ``fn`` (this thread's; equal to wall time on an idle core, and unaffected
    by other processes time-sharing it), ``before`` running untimed before each call."""
    ts = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = _cpu()
        fn()
        ts.append(_cpu() - t0)
    return float(statistics.median(ts))


class _CpuTracer:
    """Stands in for ``runtime.trace.Tracer``: spans in this thread's CPU time."""

    enabled = True

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, float, float]] = []  # name, phase, start, end

    @contextmanager
    def span(self, name: str, **args: object) -> Iterator[None]:
        t0 = _cpu()
        try:
            yield
        finally:
            self.spans.append((name, str(args.get("phase", "")), t0, _cpu()))


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _load(model_path: Path, dtype: str):
    from afdserve.model.config import ModelConfig
    from afdserve.model.loader import CheckpointReader, parse_dtype

    cfg = ModelConfig.from_pretrained(model_path)
    return cfg, CheckpointReader(model_path), parse_dtype(dtype)


def _runner(model: Any, kv: Any, links: Any, emap: Any, tracer: Any) -> Any:
    """A ``PipelinedRunner`` built as ``runtime.workers.AttentionWorker`` builds it (m = 1, the
    attention-side gate, and the expert-load tracker where the runtime has one)."""
    import inspect

    from afdserve.config import EngineConfig
    from afdserve.runtime.pipeline import PipelinedRunner

    kw: dict[str, Any] = {}
    if "tracker" in inspect.signature(PipelinedRunner.__init__).parameters:
        from afdserve.balance.load import LoadTracker

        window = getattr(EngineConfig(), "load_window", 64)
        kw["tracker"] = LoadTracker(model.cfg.num_layers, model.cfg.num_experts, window)
    return PipelinedRunner(model, kv, links, emap, 1, "attention", tracer, timeout_s=1.0, **kw)


def _expert_compute(experts: Any, num_layers: int, num_experts: int, held: int) -> Any:
    """An ``ExpertCompute`` as ``runtime.workers.ExpertWorker`` builds it, for worker 0 holding
    experts ``0 .. held-1`` (attention-side gate: no routers)."""
    import inspect

    from afdserve.runtime.expert_compute import ExpertCompute
    from afdserve.runtime.expert_map import ExpertMap

    params = inspect.signature(ExpertCompute.__init__).parameters
    if "maps" not in params:  # the runtime before replicated experts
        return ExpertCompute(experts, None)
    sizes = [held] if held == num_experts else [held, num_experts - held]
    return ExpertCompute(experts, None, 0, {0: ExpertMap.contiguous(num_layers, num_experts, len(sizes), sizes)})


def _decode_meta(b: int, s: int, block_size: int):
    """AttnMetadata of ``b`` decode sequences with ``s`` tokens each (the last one new), blocks laid
    out one sequence after the other."""
    from afdserve.model.attention import AttnMetadata

    nb = -(-s // block_size)
    slots = [torch.arange(i * nb * block_size, i * nb * block_size + s) for i in range(b)]
    return AttnMetadata.build([1] * b, slots), b * nb


# --------------------------------------------------------------------------------------------
# attention: what the attention worker does per micro-batch and layer
# --------------------------------------------------------------------------------------------
class _Msg:
    __slots__ = ("tensors",)

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors

    def release(self) -> None:
        pass


class LoopbackLinks:
    """Stands in for ``runtime.links.Links``: a ``send`` is recorded (no copy; sends are measured
    with the transport) and the matching ``recv`` returns zeros of the size the expert worker would
    send back.  ``on_recv`` runs inside the recv, where the worker would wait for the experts."""

    def __init__(self, hidden: int, dtype: torch.dtype, on_recv: Callable[[], None] | None = None):
        self.hidden, self.dtype, self.on_recv = hidden, dtype, on_recv
        self.pending: dict[int, list[int]] = {}

    def send(self, peer: int, tensors: list[torch.Tensor], meta: tuple[int, int, int, int]) -> None:
        self.pending.setdefault(peer, []).append(int(tensors[0].shape[0]))

    def recv(self, peer: int, timeout: float) -> _Msg:
        n = self.pending[peer].pop(0)
        if self.on_recv is not None:
            self.on_recv()
        return _Msg([torch.zeros(n, self.hidden, dtype=self.dtype)])

    def close(self) -> None:
        pass


@torch.inference_mode()
def measure_attention(
    model_path: Path,
    points: Sequence[tuple[int, int, int]],
    repeats: int,
    flush: CacheFlusher,
    dtype: str = "float32",
    block_size: int = 16,
    log: Callable[[str], None] = lambda s: None,
) -> list[list[float]]:
    """``[b, s, n_e, seconds]`` for each ``(b, s, n_e)`` of ``points``: one decode micro-batch of
    ``b`` sequences with ``s`` tokens of context through one layer of the attention worker, in the
    order ``PipelinedRunner`` runs it -- ``_combine`` of the previous layer's expert results
    (merge + ``post_moe``), ``pre_moe`` (attention over the paged ``KVCache`` + router) and
    ``_dispatch`` to ``n_e`` expert workers (per-worker token selection; the sends go to a
    loop-back link).  The caches are evicted before each call, where the worker would wait for the
    expert workers.  Median over ``repeats`` calls cycling through the layers."""
    from afdserve.kvcache.cache import KVCache
    from afdserve.model.model import AttentionModel
    from afdserve.runtime.expert_map import ExpertMap
    from afdserve.runtime.trace import Tracer

    cfg, reader, dt = _load(model_path, dtype)
    model = AttentionModel.load(model_path, dt, cfg, reader)
    gen = torch.Generator().manual_seed(0)
    out = []
    for b, s, n_e in points:
        s = max(2, min(int(s), cfg.max_position_embeddings - 1))
        n_e = max(1, min(int(n_e), cfg.num_experts))
        meta, blocks = _decode_meta(b, s, block_size)
        kv = KVCache(cfg, blocks, block_size, dt)
        kv.k.normal_(0, 1, generator=gen)
        kv.v.normal_(0, 1, generator=gen)
        emap = ExpertMap.contiguous(cfg.num_layers, cfg.num_experts, n_e)
        runner = _runner(model, kv, LoopbackLinks(cfg.hidden_size, dt), emap, Tracer("profile"))
        x = (torch.randn(b, cfg.hidden_size, generator=gen) * 0.1).to(dt)
        cos_sin = model.rotary.cos_sin(meta.positions, dt)
        state: dict[str, Any] = {"n": 0, "flight": None}

        def call() -> None:
            lyr = state["n"] % cfg.num_layers
            state["n"] += 1
            if state["flight"] is not None:
                runner._combine(0, (lyr - 1) % cfg.num_layers, state["flight"])
            h, y, ids, w = model.pre_moe(lyr, x, cos_sin, meta, kv)
            state["flight"] = runner._dispatch(0, lyr, h, y, ids, w)

        call()  # warm-up (allocator, kernels)
        t = _median_time(call, repeats, flush)
        out.append([float(b), float(s), float(n_e), t])
        log(f"  attention b={b:<4} s={s:<5} n_e={n_e:<2} {t * 1e6:9.1f} us")
    return out


def attention_points(grid: "ProfileGrid", num_experts: int) -> list[tuple[int, int, int]]:
    """The (b, s, n_e) grid: every b x s with one expert worker, and every b at the shortest s with
    each other worker count (the per-worker cost of the dispatch)."""
    pts = [(b, s, 1) for s in grid.seq_lens for b in grid.batches]
    s0 = min(grid.seq_lens)
    pts += [(b, s0, n) for n in grid.dispatch_workers if 1 < n <= num_experts for b in grid.batches]
    return pts


# --------------------------------------------------------------------------------------------
# experts: Te(b_e) for each number of experts per worker
# --------------------------------------------------------------------------------------------
@torch.inference_mode()
def measure_expert(
    model_path: Path,
    experts_per_node: Sequence[int],
    pairs_per_expert: Sequence[int],
    repeats: int,
    flush: CacheFlusher,
    dtype: str = "float32",
    log: Callable[[str], None] = lambda s: None,
) -> dict[int, list[list[float]]]:
    """``{experts held: [[pairs, seconds], ...]}``: ``ExpertCompute.run`` of one layer over ``pairs``
    token-expert pairs, every held expert receiving the same number (tokens pick K distinct
    experts, all held by this worker)."""
    from afdserve.model.model import ExpertModel

    cfg, reader, dt = _load(model_path, dtype)
    k = cfg.top_k
    gen = torch.Generator().manual_seed(1)
    out: dict[int, list[list[float]]] = {}
    for epn in experts_per_node:
        held = list(range(epn))
        compute = _expert_compute(ExpertModel.load(model_path, held, dt, cfg, reader), cfg.num_layers,
                                  cfg.num_experts, epn)
        rows: list[list[float]] = []
        for c in pairs_per_expert:
            pairs = c * epn
            kk = min(k, epn)
            tokens = -(-pairs // kk)
            # token t takes experts (t*kk + j) mod epn: every held expert gets pairs/epn pairs
            ids = torch.tensor([[(t * kk + j) % epn for j in range(kk)] for t in range(tokens)], dtype=torch.int32)
            if kk < k:  # the token's other experts live on other workers (id E = "elsewhere")
                ids = torch.cat([ids, torch.full((tokens, k - kk), cfg.num_experts, dtype=torch.int32)], 1)
            y = (torch.randn(tokens, cfg.hidden_size, generator=gen) * 0.1).to(dt)
            w = torch.rand(tokens, k, generator=gen)
            layer = [0]

            def call() -> None:
                lyr = layer[0] % cfg.num_layers
                layer[0] += 1
                compute.run(lyr, [[y, ids, w]])

            call()
            t = _median_time(call, repeats, flush)
            real_pairs = tokens * kk
            rows.append([float(real_pairs), t])
            log(f"  experts={epn:<3} pairs={real_pairs:<5} {t * 1e6:9.1f} us")
        out[epn] = rows
        del compute
    return out


# --------------------------------------------------------------------------------------------
# transport: the M2N library between two processes
# --------------------------------------------------------------------------------------------
def _message(tokens: int, hidden: int, top_k: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """What the attention worker dispatches: y, expert ids (int32), weights (float32)."""
    return [torch.randn(tokens, hidden).to(dtype), torch.zeros(tokens, top_k, dtype=torch.int32),
            torch.rand(tokens, top_k)]


def _links(name: str, peer: str, store_addr: tuple[str, int], group: str, slot_bytes: int):
    from datetime import timedelta

    from torch.distributed import TCPStore

    from afdserve.comm import CommConfig, Communicator
    from afdserve.runtime.links import Links

    store = TCPStore(store_addr[0], store_addr[1], is_master=False, timeout=timedelta(seconds=60))
    comm = Communicator(name, store, CommConfig(slot_bytes=slot_bytes, num_slots=4, deadline_s=10.0,
                                                connect_timeout_s=60.0), group=group)
    comm.connect(send_to=[peer], recv_from=[peer])
    return Links(comm, [peer])


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _transport_peer(argv: Sequence[str]) -> None:
    """The expert-worker side of :func:`measure_transport` (``python -m afdserve.planner.profiler
    --transport-peer JSON``); sends its own timings back over the link at the end."""
    import json

    a = json.loads(argv[0])
    torch.set_num_threads(1)
    dt = getattr(torch, a["dtype"])
    n, busy = a["repeats"], a["busy_s"]
    links = _links("expert", "attention", tuple(a["store"]), a["group"], a["slot_bytes"])
    try:
        rows = []  # per size: [take a waiting message, reply to a spinning peer, reply to a sleeping peer]
        for tokens in a["plan"]:
            reply = [torch.randn(tokens, a["hidden"]).to(dt)]
            take, fast, ring = [], [], []
            for phase in ("fast", "asleep", "busy"):
                for i in range(n + 2):
                    if phase == "busy":
                        _spin(busy)  # "computing" while the next message arrives
                    t0 = _cpu()
                    for _i, msg in links.gather(30.0):
                        msg.release()
                    t1 = _cpu()
                    links.send(0, reply, (0, 0, 0, 0))
                    t2 = _cpu()
                    if i >= 2:
                        if phase == "busy":
                            take.append(t1 - t0)  # CPU time: the message was there, nothing to wait for
                            ring.append(t2 - t1)  # the sender sleeps in recv by now
                        else:
                            fast.append(t2 - t1)
            rows.append([statistics.median(take), statistics.median(fast), statistics.median(ring)])
        links.send(0, [torch.tensor(rows, dtype=torch.float64)], (0, 0, 0, 2))
        links.comm.recv("attention", timeout=30.0).release()  # the parent's goodbye
    finally:
        links.close()


@dataclass
class TransportSamples:
    """Samples of :func:`measure_transport` (``[bytes, seconds]`` each)."""

    oneway: list[list[float]] = field(default_factory=list)  # half the round trip, both sides spinning
    send: list[list[float]] = field(default_factory=list)  # Links.send, receiver spinning or busy
    send_ring: list[list[float]] = field(default_factory=list)  # Links.send, receiver asleep in poll
    take: list[list[float]] = field(default_factory=list)  # gather + release of an arrived message
    wake: list[list[float]] = field(default_factory=list)  # extra delay to a receiver asleep in poll

    def as_dict(self) -> dict[str, list[list[float]]]:
        return {"oneway": self.oneway, "send": self.send, "send_ring": self.send_ring, "take": self.take,
                "wake": self.wake}


def _pin_pair(peer_pid: int, pin: bool) -> set[int] | None:
    """Pins this process and the peer to two different cores (as a deployment's workers on cores
    of their own); returns this process's previous affinity (None: not pinned)."""
    if not pin or not hasattr(os, "sched_setaffinity"):
        return None
    mask = os.sched_getaffinity(0)
    if len(mask) < 2:
        return None
    a, b = sorted(mask)[:2]
    os.sched_setaffinity(0, {a})
    try:
        os.sched_setaffinity(peer_pid, {b})
    except OSError:
        os.sched_setaffinity(0, mask)
        return None
    return mask


def measure_transport(
    hidden: int,
    top_k: int,
    msg_tokens: Sequence[int],
    repeats: int,
    dtype: str = "float32",
    log: Callable[[str], None] = lambda s: None,
    pin: bool = True,
) -> TransportSamples:
    """Two processes connected by ``afdserve.comm`` as the runtime connects its workers (``Links``,
    transport ``auto``: shared memory on one x86-64 machine), exchanging dispatch messages
    ``[y, expert ids, weights]`` of ``tokens`` tokens and replies ``[partial sums]``, in three
    phases per size:

    * *fast*: each side sends as soon as it has the other's message (the receiver is still spinning):
      half the round trip (wall time) is the transport's one-way time (the planner's latency /
      bandwidth / Util);
    * *asleep*: the sender computes 1 ms first, so the receiver has gone to sleep in ``poll``: the
      extra round-trip time is the wake-up latency (and the sender's ``send`` rings the socket);
    * *busy*: the receiver computes 1 ms before it looks, so the message is already there: the cost
      of taking it (``gather`` + ``release``), as an expert worker between two rounds.

    Sends and takes are timed in CPU time, round trips in wall time (so profile an idle machine).
    With ``pin`` (and two cores or more) the two processes are pinned to two different cores, as
    workers on cores of their own: a wake-up then crosses cores.
    """
    import json
    import subprocess

    from afdserve.runtime.launcher import start_store

    dt = getattr(torch, dtype)
    elem = torch.empty((), dtype=dt).element_size()
    plan = [int(t) for t in msg_tokens]
    slot_bytes = max(plan) * (hidden * 4 + top_k * 8) + 4 * 64
    busy = 1e-3
    store = start_store()
    group = f"profile_{os.getpid()}_{secrets.token_hex(3)}"
    arg = json.dumps({"store": list(store.addr), "group": group, "slot_bytes": slot_bytes, "plan": plan,
                      "repeats": repeats, "hidden": hidden, "dtype": dtype, "busy_s": busy})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "afdserve.planner.profiler", "--transport-peer", arg], env=env)
    res = TransportSamples()
    links = None
    mask = _pin_pair(proc.pid, pin)
    try:
        links = _links("attention", "expert", store.addr, group, slot_bytes)
        mine = []
        for tokens in plan:
            msg = _message(tokens, hidden, top_k, dt)
            fwd = sum(t.numel() * t.element_size() for t in msg)
            back = tokens * hidden * elem
            t_rtt: dict[str, list[float]] = {"fast": [], "asleep": []}
            t_send: dict[str, list[float]] = {"fast": [], "asleep": []}
            for phase in ("fast", "asleep", "busy"):
                for i in range(repeats + 2):
                    if phase == "asleep":
                        _spin(busy)
                    t0, c0 = time.perf_counter(), _cpu()
                    links.send(0, msg, (0, 0, 0, 0))
                    c1 = _cpu()
                    links.recv(0, 30.0).release()
                    if i >= 2 and phase in t_rtt:
                        t_rtt[phase].append(time.perf_counter() - t0)
                        t_send[phase].append(c1 - c0)
            mine.append((fwd, back, {k: statistics.median(v) for k, v in t_rtt.items()},
                         {k: statistics.median(v) for k, v in t_send.items()}))
        msg = links.recv(0, 30.0)
        peer_rows = msg.tensors[0].tolist()
        msg.release()
        links.send(0, [torch.zeros(1)], (0, 0, 0, 3))  # goodbye
        for tokens, (fwd, back, rtt, snd), (take, reply_fast, reply_ring) in zip(plan, mine, peer_rows):
            res.oneway.append([(fwd + back) / 2, rtt["fast"] / 2])
            res.send += [[float(fwd), snd["fast"]], [float(back), reply_fast]]
            res.send_ring += [[float(fwd), snd["asleep"]], [float(back), reply_ring]]
            res.take.append([float(fwd), take])
            wake = max(0.0, rtt["asleep"] - rtt["fast"] - (snd["asleep"] - snd["fast"]))
            res.wake.append([float(fwd), wake])
            log(f"  transport tokens={tokens:<5} {fwd:>9} B  one-way {rtt['fast'] / 2 * 1e6:7.1f} us  "
                f"send {snd['fast'] * 1e6:6.1f} us (to a sleeper {snd['asleep'] * 1e6:6.1f})  "
                f"take {take * 1e6:6.1f} us  wake-up {wake * 1e6:6.1f} us")
        proc.wait(30)
    finally:
        if mask is not None:
            os.sched_setaffinity(0, mask)
        if links is not None:
            links.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        store.close()
    if proc.returncode != 0:
        raise RuntimeError(f"transport peer exited with code {proc.returncode}")
    return res


# --------------------------------------------------------------------------------------------
# per-step overhead of the engine outside the layers
# --------------------------------------------------------------------------------------------
class _PipeSink:
    """The worker's control pipe to the front end: a real pipe whose far end a thread drains."""

    def __init__(self) -> None:
        r, w = os.pipe()
        self.conn = Connection(w, readable=False)
        self._r = r
        self._t = threading.Thread(target=self._drain, daemon=True)
        self._t.start()

    def _drain(self) -> None:
        while os.read(self._r, 1 << 20):
            pass

    def close(self) -> None:
        self.conn.close()
        self._t.join(5)
        os.close(self._r)


def measure_step(
    model_path: Path,
    batches: Sequence[int],
    repeats: int,
    flush: CacheFlusher,
    dtype: str = "float32",
    prompt_len: int = 8,
    log: Callable[[str], None] = lambda s: None,
) -> tuple[list[list[float]], list[list[float]]]:
    """``([b, overhead_s], [rows, lm_head_s])``: the per-step work of an attention worker outside
    its layers -- scheduling, metadata, micro-batch split, embedding, sampling, detokenizing, and
    shipping the outputs over a pipe as the worker does -- and the LM head of a micro-batch (timed
    apart because the runtime runs it per micro-batch).  Timed in CPU time with the real ``Engine``
    driving the attention worker's ``PipelinedRunner`` (loop-back links, one expert worker,
    ``m = 1``): a decode step minus the span from its first layer's attention to its last span,
    the LM head spans from the runner's own trace (when the runtime traces it; otherwise the LM
    head stays in the overhead)."""
    from afdserve.config import EngineConfig
    from afdserve.engine.builder import build_attention_engine
    from afdserve.engine.sampling_params import SamplingParams
    from afdserve.model.config import ModelConfig
    from afdserve.runtime.deltas import DeltaEncoder
    from afdserve.runtime.expert_map import ExpertMap

    cfg_m = ModelConfig.from_pretrained(model_path)
    over, head = [], []
    sink = _PipeSink()
    try:
        for b in batches:
            steps = repeats + 2
            max_len = min(cfg_m.max_position_embeddings, prompt_len + steps + 8)
            ecfg = EngineConfig(model=str(model_path), dtype=dtype, max_num_seqs=b, num_threads=1,
                                max_model_len=max_len, num_kv_blocks=b * -(-max_len // 16) + 1)
            eng = build_attention_engine(ecfg, Path(model_path), cfg_m, moe=lambda *a: None)
            base = eng.runner
            tracer = _CpuTracer()
            links = LoopbackLinks(cfg_m.hidden_size, base.model.dtype, on_recv=flush)
            emap = ExpertMap.contiguous(cfg_m.num_layers, cfg_m.num_experts, 1)
            eng.runner = _runner(base.model, base.kv, links, emap, tracer)
            gen = torch.Generator().manual_seed(3)
            params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
            for i in range(b):
                ids = torch.randint(3, cfg_m.vocab_size, (prompt_len,), generator=gen).tolist()
                eng.add_request({"prompt_token_ids": ids}, params, request_id=f"p{i}")
            eng.step()  # prefill
            sink.conn.send(("out", [], {}))
            ts, hs = [], []
            deltas = DeltaEncoder()
            deltas.encode(eng.step())  # the first decode step
            for _ in range(repeats):
                flush()
                tracer.spans.clear()
                t0 = _cpu()
                outs = eng.step()
                stats = {"running": len(eng.scheduler.running), "step_s": eng.last_step.seconds}
                sink.conn.send(("out", deltas.encode(outs), stats))
                total = _cpu() - t0
                first = min(sp[2] for sp in tracer.spans)
                last = max(sp[3] for sp in tracer.spans)
                ts.append(total - (last - first))
                lm = [sp[3] - sp[2] for sp in tracer.spans if sp[1] == "lm_head"]
                hs.append(sum(lm) if lm else 0.0)
            t, h = float(statistics.median(ts)), float(statistics.median(hs))
            over.append([float(b), t])
            head.append([float(b), h])
            log(f"  step overhead b={b:<4} {t * 1e3:8.3f} ms   LM head {h * 1e3:8.3f} ms")
            del eng
    finally:
        sink.close()
    return over, head


# --------------------------------------------------------------------------------------------
# two workers computing at once: what they cost each other (shared LLC / memory bandwidth)
# --------------------------------------------------------------------------------------------
def _attention_work(model_path: Path, cfg: Any, reader: Any, dt: torch.dtype) -> tuple[Callable[[int], None],
                                                                                      Callable[[], None]]:
    """An attention worker's work on a decode micro-batch of 16 (64 tokens of context): ``(one
    layer, the LM head)``."""
    from afdserve.kvcache.cache import KVCache
    from afdserve.model.model import AttentionModel

    model = AttentionModel.load(model_path, dt, cfg, reader)
    meta, blocks = _decode_meta(16, 64, 16)
    kv = KVCache(cfg, blocks, 16, dt)
    x = torch.randn(16, cfg.hidden_size).to(dt)
    cos_sin = model.rotary.cos_sin(meta.positions, dt)

    def layer(lyr: int) -> None:
        h, y, _ids, _w = model.pre_moe(lyr, x, cos_sin, meta, kv)
        model.post_moe(lyr, h, y, torch.zeros_like(y))

    return layer, lambda: model.logits(x)


def _expert_work(model_path: Path, cfg: Any, reader: Any, dt: torch.dtype,
                 pairs_per_expert: int) -> Callable[[int], None]:
    """An expert worker holding every expert: one layer over ``pairs_per_expert`` pairs an expert."""
    from afdserve.model.model import ExpertModel

    compute = _expert_compute(ExpertModel.load(model_path, None, dt, cfg, reader), cfg.num_layers,
                              cfg.num_experts, cfg.num_experts)
    k = cfg.top_k
    tokens = pairs_per_expert * cfg.num_experts // k
    ids = torch.tensor([[(t * k + j) % cfg.num_experts for j in range(k)] for t in range(tokens)], dtype=torch.int32)
    y, w = torch.randn(tokens, cfg.hidden_size).to(dt), torch.rand(tokens, k)
    return lambda lyr: compute.run(lyr, [[y, ids, w]])


@torch.inference_mode()
def _hog(argv: Sequence[str]) -> None:
    """``python -m afdserve.planner.profiler --hog ROLE MODEL DTYPE SECONDS``: one worker role's
    work in a loop (as a partner process for :func:`measure_corun`)."""
    role, model_path, dtype, seconds = argv[0], Path(argv[1]), argv[2], float(argv[3])
    torch.set_num_threads(1)
    cfg, reader, dt = _load(model_path, dtype)
    end = time.monotonic() + seconds
    if role == "expert":  # rounds of 8 pairs per expert
        expert_layer = _expert_work(model_path, cfg, reader, dt, 8)
        print("ready", flush=True)
        layer = 0
        while time.monotonic() < end:
            expert_layer(layer % cfg.num_layers)
            layer += 1
    else:  # every layer, then the LM head
        attention_layer, lm_head = _attention_work(model_path, cfg, reader, dt)
        print("ready", flush=True)
        while time.monotonic() < end:
            for lyr in range(cfg.num_layers):
                attention_layer(lyr)
            lm_head()


def measure_corun(
    model_path: Path,
    repeats: int,
    flush: CacheFlusher,
    dtype: str = "float32",
    log: Callable[[str], None] = lambda s: None,
) -> tuple[float, float]:
    """``(attention factor, expert factor)``: how much longer (CPU time) an attention worker's work
    (a micro-batch of 16 through a layer, and the LM head) and an expert worker's round take while the
    other role computes on another core, than alone.  (1.0, 1.0) with fewer than two cores."""
    import subprocess

    if cpu_cores() < 2 or not hasattr(os, "sched_setaffinity"):
        return 1.0, 1.0
    cfg, reader, dt = _load(model_path, dtype)
    attention_layer, lm_head = _attention_work(model_path, cfg, reader, dt)
    expert_layer = _expert_work(model_path, cfg, reader, dt, 4)
    n = [0]

    def attention() -> None:
        attention_layer(n[0] % cfg.num_layers)
        n[0] += 1

    def expert() -> None:
        expert_layer(n[0] % cfg.num_layers)
        n[0] += 1

    mask = os.sched_getaffinity(0)
    a, b = sorted(mask)[:2]
    os.sched_setaffinity(0, {a})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ratios: dict[str, list[float]] = {"attention": [], "expert": []}
    try:
        for partner, mine in (("expert", (attention, lm_head)), ("attention", (expert,))):
            alone = [_median_time(fn, repeats, flush) for fn in mine]
            proc = subprocess.Popen([sys.executable, "-m", "afdserve.planner.profiler", "--hog", partner,
                                     str(model_path), dtype, "300"], env=env, stdout=subprocess.PIPE, text=True)
            try:
                os.sched_setaffinity(proc.pid, {b})
                assert proc.stdout is not None
                import select

                ready, _, _ = select.select([proc.stdout], [], [], 120)
                if not ready or proc.stdout.readline().strip() != "ready":  # it loaded its weights
                    raise RuntimeError(f"co-run partner did not start (exit code {proc.poll()})")
                time.sleep(0.2)
                together = [_median_time(fn, repeats, flush) for fn in mine]
            finally:
                proc.kill()
                proc.wait(10)
            alone2 = [_median_time(fn, repeats, flush) for fn in mine]
            # alone before the partner started and after it was killed: compare with the mean of
            # both, so a drift of the machine's speed during the measurement cancels
            role = "attention" if partner == "expert" else "expert"
            for t, a1, a2 in zip(together, alone, alone2):
                ratios[role].append(t / ((a1 + a2) / 2))
    finally:
        os.sched_setaffinity(0, mask)
    fa = max(1.0, float(np.mean(ratios["attention"])))
    fe = max(1.0, float(np.mean(ratios["expert"])))
    log(f"  attention worker x{fa:.3f} while an expert worker computes, expert worker x{fe:.3f} "
        f"while an attention worker computes")
    return fa, fe


# --------------------------------------------------------------------------------------------
# the whole profile
# --------------------------------------------------------------------------------------------
def _model_name(path: Path) -> str:
    from afdserve.model.demo import demo_model_path

    try:
        if path.resolve() == demo_model_path().resolve():
            return "demo"
    except OSError:
        pass
    return path.name or str(path)


def fit_runtime(transport: TransportSamples, attention: Sequence[Sequence[float]], cores: int,
                spin_s: float) -> RuntimeCosts:
    """Runtime costs from the transport samples and the attention rows with more than one expert
    worker (see :class:`afdserve.planner.profile.RuntimeCosts`)."""
    (send_s, send_b), _ = fit_affine([[1.0] * len(transport.send), [r[0] for r in transport.send]],
                                     [r[1] for r in transport.send], relative=True)
    ring = [r[1] - (send_s + send_b * r[0]) for r in transport.send_ring]
    one = {(r[0], r[1]): r[3] for r in attention if r[2] == 1}
    extra = [(r[3] - one[(r[0], r[1])]) / (r[2] - 1) for r in attention if r[2] > 1 and (r[0], r[1]) in one]
    return RuntimeCosts(
        cores=cores,
        send_s=send_s,
        send_per_byte_s=send_b,
        ring_s=max(0.0, float(np.median(ring))) if ring else 0.0,
        take_s=float(np.median([r[1] for r in transport.take])) if transport.take else 0.0,
        wake_s=float(np.median([r[1] for r in transport.wake])) if transport.wake else 0.0,
        spin_s=spin_s,
        dispatch_per_worker_s=max(0.0, float(np.median(extra))) if extra else 0.0,
    )


def run_profile(
    model: str | Path | None = None,
    grid: ProfileGrid = DEFAULT_GRID,
    *,
    dtype: str = "float32",
    evict: bool = True,
    gpu: str = "cpu",
    log: Callable[[str], None] = lambda s: None,
) -> Profile:
    """Measures everything (see the module docstring) and fits a :class:`Profile`."""
    from afdserve.comm import CommConfig
    from afdserve.engine.builder import resolve_model
    from afdserve.model.config import ModelConfig

    torch.set_num_threads(1)
    path = resolve_model(None if model is None else str(model))
    cfg = ModelConfig.from_pretrained(path)
    flush = CacheFlusher(evict)
    t_start = time.perf_counter()
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()

    idle = idle_fraction()
    log(f"profiling {path} ({dtype}) on {cpu_name()}, {cpu_cores()} cores; LLC {llc_bytes() >> 20} MiB"
        f"{' evicted before every timed call' if evict else ' (warm: not evicted)'}; machine {idle:.0%} idle")
    if idle < 0.8:
        log("warning: other processes are using the CPUs; compute is timed in CPU time, but the transport's "
            "latencies (wall time) will be inflated -- profile an idle machine")
    passes = max(1, grid.passes)
    quiet = (lambda s: None) if passes > 1 else log

    def least(runs: list[list[list[float]]], key: int) -> list[list[float]]:
        """Per point, the pass with the least time: other processes' work only ever adds time."""
        return [min(rows, key=lambda r: r[key]) for rows in zip(*runs)]

    log(f"attention worker, per micro-batch and layer ({passes} passes x {grid.repeats} calls):")
    points = attention_points(grid, cfg.num_experts)
    att = least([measure_attention(path, points, grid.repeats, flush, dtype, log=quiet) for _ in range(passes)], 3)
    for b, s, n_e, t in att:
        log(f"  b={int(b):<4} s={int(s):<5} n_e={int(n_e):<2} {t * 1e6:9.1f} us")
    log("expert worker, per layer:")
    epns = grid.experts_per_node or _divisors(cfg.num_experts)
    epns = tuple(e for e in epns if 1 <= e <= cfg.num_experts and cfg.num_experts % e == 0)
    exp_runs = [measure_expert(path, epns, grid.pairs_per_expert, grid.repeats, flush, dtype, log=quiet)
                for _ in range(passes)]
    exp = {e: least([run[e] for run in exp_runs], 1) for e in epns}
    for e, rows in exp.items():
        log(f"  experts={e:<3} " + "  ".join(f"{int(p)} pairs {t * 1e6:.0f} us" for p, t in rows))
    log("M2N transport (afdserve.comm between two processes):")
    tr = measure_transport(cfg.hidden_size, cfg.top_k, grid.msg_tokens, grid.transport_repeats, dtype, log=log)
    log("two workers computing at once (each on its own core):")
    corun_a, corun_e = measure_corun(path, grid.repeats * passes, flush, dtype, log=log) if grid.corun else (1.0, 1.0)
    log("engine step outside the layers:")
    step_runs = [measure_step(path, grid.step_batches, grid.repeats, flush, dtype, log=quiet) for _ in range(passes)]
    step = least([r[0] for r in step_runs], 1)
    lm_head = least([r[1] for r in step_runs], 1)
    for (b, t), (_, h) in zip(step, lm_head):
        log(f"  b={int(b):<4} overhead {t * 1e3:8.3f} ms   LM head {h * 1e3:8.3f} ms")

    att_1 = [[r[0], r[1], r[3]] for r in att if r[2] == 1]
    try:
        network = fit_network(tr.oneway)
    except ValueError:  # sizes too small (or too noisy) to see the bandwidth: bound it by memcpy's
        from afdserve.comm.bench import memcpy_gbps

        network = NetworkProfile(latency_s=float(np.median([r[1] for r in tr.oneway])),
                                 bandwidth_Bps=memcpy_gbps(64 << 20, 3) * 1e9)
        log(f"  (one-way time does not grow with these sizes: bandwidth bounded by memcpy, "
            f"{network.bandwidth_Bps / 1e9:.1f} GB/s)")
    prof = Profile(
        model=_model_name(path),
        attention=(fit_attention(att_1, tp=1, gpu=gpu, relative=True),),
        expert=tuple(fit_expert(rows, tp=1, experts_per_node=e, gpu=gpu, relative=True) for e, rows in exp.items()),
        network=network,
        wire=WireFormat(act_bytes=elem, meta_bytes_per_token=cfg.top_k * 8, dispatch="routed"),
        device=f"{cpu_name()} ({cpu_cores()} cores, 1 thread per worker)",
    )
    (fixed, per_tok), _ = fit_affine([[1.0] * len(step), [r[0] for r in step]], [r[1] for r in step], relative=True)
    runtime = fit_runtime(tr, att, cpu_cores(), CommConfig().spin_s)
    if any(r[1] > 0 for r in lm_head):
        (h0, h1), _ = fit_affine([[1.0] * len(lm_head), [r[0] for r in lm_head]], [r[1] for r in lm_head],
                                 relative=True)
        runtime = replace(runtime, lm_head_s=h0, lm_head_per_token_s=h1,
                          lm_head_points=tuple(sorted((r[0], r[1]) for r in lm_head)))
    runtime = replace(runtime, corun_attention=corun_a, corun_expert=corun_e)
    samples: dict[str, list[list[float]]] = {"attention": att_1}
    samples["attention_workers"] = [list(map(float, r)) for r in att]
    samples["expert"] = [[float(e), r[0], r[1]] for e, rows in exp.items() for r in rows]
    samples.update({f"transport_{k}": v for k, v in tr.as_dict().items()})
    samples["step"] = step
    samples["lm_head"] = lm_head
    took = time.perf_counter() - t_start
    notes = (f"afdserve profile: {len(att)} attention, {sum(len(v) for v in exp.values())} expert, "
             f"{len(tr.oneway)} transport, {len(step)} step points; least of {passes} passes' medians of "
             f"{grid.repeats} calls "
             f"({grid.transport_repeats} round trips); caches {'evicted before each call' if evict else 'warm'}; "
             f"dtype {dtype}; torch {torch.__version__}; {took:.0f} s; machine {idle:.0%} idle at the start")
    samples["network"] = [list(map(float, r)) for r in tr.oneway]
    return replace(prof, step_fixed_s=fixed, step_per_token_s=per_tok, runtime=runtime,
                   samples=samples, notes=notes)


def summary(prof: Profile) -> str:
    """The fitted constants, one per line."""
    lines = [f"model {prof.model}; device {prof.device}"]
    for a in prof.attention:
        lines.append(f"attention (tp {a.tp}): Ta = (k1_tok + k1_ctx*s)*b + k2: k1_tok {a.k1_tok * 1e6:.3f} us, "
                     f"k1_ctx {a.k1_ctx * 1e9:.3f} ns, k2 {a.k2 * 1e6:.1f} us "
                     f"(rmse {0 if a.rmse_s is None else a.rmse_s * 1e6:.1f} us, {a.n_samples} points)")
    for e in prof.expert:
        lines.append(f"experts x{e.experts_per_node:<2} Te = k3*b_e + k4: k3 {e.k3 * 1e6:.3f} us, "
                     f"k4 {e.k4 * 1e6:.1f} us (rmse {0 if e.rmse_s is None else e.rmse_s * 1e6:.1f} us)")
    if prof.network is not None:
        n = prof.network
        u = n.util_curve()
        lines.append(f"M2N one-way: latency {n.latency_s * 1e6:.1f} us, bandwidth {n.bandwidth_Bps / 1e9:.2f} GB/s; "
                     f"Util(64 KiB) {u(65536):.2f}, Util(1 MiB) {u(1 << 20):.2f}")
    lines.append(f"step overhead: {prof.step_fixed_s * 1e3:.3f} ms + {prof.step_per_token_s * 1e6:.1f} us/sequence")
    if prof.runtime is not None and (prof.runtime.lm_head_s or prof.runtime.lm_head_per_token_s):
        lines.append(f"LM head per micro-batch: {prof.runtime.lm_head_s * 1e3:.3f} ms + "
                     f"{prof.runtime.lm_head_per_token_s * 1e6:.1f} us/sequence")
    if prof.runtime is not None:
        r = prof.runtime
        lines.append(f"runtime: send {r.send_s * 1e6:.1f} us + {r.send_per_byte_s * 1e12:.1f} ps/B "
                     f"(+{r.ring_s * 1e6:.1f} us to a sleeper), take {r.take_s * 1e6:.1f} us, "
                     f"wake-up {r.wake_s * 1e6:.1f} us, dispatch +{r.dispatch_per_worker_s * 1e6:.1f} us/expert "
                     f"worker, {r.cores} cores; computing at once: attention x{r.corun_attention:.3f}, "
                     f"experts x{r.corun_expert:.3f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("expected positive integers")
    return vals


def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--out", type=Path, required=True, help="where to write the profile (JSON)")
    p.add_argument("--model", default=None, help="model folder (default: the built-in demo model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and activations, as the deployment will run (default float32)")
    p.add_argument("--quick", action="store_true", help="a small grid (about a third of the time)")
    p.add_argument("--batches", type=_ints, help="attention micro-batch sizes b_a")
    p.add_argument("--seq-lens", type=_ints, help="context lengths s")
    p.add_argument("--pairs-per-expert", type=_ints, help="token-expert pairs per held expert")
    p.add_argument("--experts-per-node", type=_ints, help="expert counts per worker (default: divisors of E)")
    p.add_argument("--msg-tokens", type=_ints, help="tokens per M2N message")
    p.add_argument("--step-batches", type=_ints, help="sequences per engine step")
    p.add_argument("--repeats", type=int, help="timed calls per point and pass (median)")
    p.add_argument("--passes", type=int, help="passes over the grid (a point keeps its least median)")
    p.add_argument("--warm", action="store_true", help="do not evict the caches before timed calls")
    p.add_argument("--no-corun", action="store_true",
                   help="skip measuring how two workers computing at once slow each other (factors 1)")
    p.add_argument("--gpu", default="cpu", help="device label of the entries (catalog name; default cpu)")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    return p


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register ``profile`` on the main CLI's subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "profile",
        help="measure k1..k4, Util and runtime costs of this machine for the planner",
        description="Run the real attention/expert code and M2N transport over a grid, fit the planner's "
                    "constants and save them (afdserve plan --profile, planner.predict_iteration_time).",
    )
    _configure(p)
    p.set_defaults(func=main)
    return p


def grid_from_args(args: argparse.Namespace) -> ProfileGrid:
    g = QUICK_GRID if args.quick else DEFAULT_GRID
    over: dict[str, Any] = {}
    for name in ("batches", "seq_lens", "pairs_per_expert", "experts_per_node", "msg_tokens", "step_batches"):
        if getattr(args, name, None):
            over[name] = tuple(getattr(args, name))
    for name in ("repeats", "passes"):
        v = getattr(args, name, None)
        if v is not None:
            if v < 1:
                raise SystemExit(f"afdserve profile: --{name} must be >= 1")
            over[name] = v
    if getattr(args, "no_corun", False):
        over["corun"] = False
    return replace(g, **over)


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    if not isinstance(args, argparse.Namespace):
        argv = list(sys.argv[1:] if args is None else args)
        if argv and argv[0] == "profile":
            argv = argv[1:]
        args = _configure(argparse.ArgumentParser(prog="afdserve profile")).parse_args(argv)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    t0 = time.perf_counter()
    prof = run_profile(args.model, grid_from_args(args), dtype=args.dtype, evict=not args.warm, gpu=args.gpu,
                       log=log)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_profile(prof, args.out)
    print(summary(prof))
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--transport-peer":
        _transport_peer(sys.argv[2:])
    elif len(sys.argv) > 2 and sys.argv[1] == "--hog":
        _hog(sys.argv[2:])
    else:
        sys.exit(main())
