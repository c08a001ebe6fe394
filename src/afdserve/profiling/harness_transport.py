"""The M2N transport between an attention and an expert worker process (the profile's latency,
bandwidth => Util, and the runtime's send / take / wake-up costs).

This process is the attention worker; ``python -m afdserve.profiling.transport_peer`` the expert
worker, connected by ``afdserve.comm`` in the runtime's ``Links``.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
from torch.distributed import TCPStore

from afdserve.comm import CommConfig, Communicator
from afdserve.planner.fitting import TransportSamples
from afdserve.profiling.timers import cpu_time
from afdserve.runtime import ExpertInput, LayerKey, Links

__all__ = ["measure_transport", "connect_pair", "dispatch_message", "pin_pair", "spin"]


def dispatch_message(tokens: int, hidden: int, top_k: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """What the attention worker dispatches: y, expert ids (int32), weights (float32)."""
    return [torch.randn(tokens, hidden).to(dtype), torch.zeros(tokens, top_k, dtype=torch.int32),
            torch.rand(tokens, top_k)]


def connect_pair(name: str, peer: str, store_addr: tuple[str, int], group: str, slot_bytes: int) -> Links:
    """``Links`` between this process (``name``) and ``peer``, as the runtime connects its workers."""
    store = TCPStore(store_addr[0], store_addr[1], is_master=False, timeout=timedelta(seconds=60))
    comm = Communicator(name, store, CommConfig(slot_bytes=slot_bytes, num_slots=4, deadline_s=10.0,
                                                connect_timeout_s=60.0), group=group)
    comm.connect(send_to=[peer], recv_from=[peer])
    return Links(comm, [peer])


def spin(seconds: float) -> None:
    """Computes (busy-waits) for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def pin_pair(peer_pid: int, pin: bool) -> set[int] | None:
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
    dt = getattr(torch, dtype)
    elem = torch.empty((), dtype=dt).element_size()
    plan = [int(t) for t in msg_tokens]
    slot_bytes = max(plan) * (hidden * 4 + top_k * 8) + 4 * 64
    busy = 1e-3
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the rendezvous of the pair
    addr = ("127.0.0.1", store.port)
    group = f"profile_{os.getpid()}_{secrets.token_hex(3)}"
    arg = json.dumps({"store": list(addr), "group": group, "slot_bytes": slot_bytes, "plan": plan,
                      "repeats": repeats, "hidden": hidden, "dtype": dtype, "busy_s": busy})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "afdserve.profiling.transport_peer", arg], env=env)
    res = TransportSamples()
    links = None
    mask = pin_pair(proc.pid, pin)
    try:
        links = connect_pair("attention", "expert", addr, group, slot_bytes)
        mine = []
        for tokens in plan:
            msg = dispatch_message(tokens, hidden, top_k, dt)
            fwd = sum(t.numel() * t.element_size() for t in msg)
            back = tokens * hidden * elem
            t_rtt: dict[str, list[float]] = {"fast": [], "asleep": []}
            t_send: dict[str, list[float]] = {"fast": [], "asleep": []}
            for phase in ("fast", "asleep", "busy"):
                for i in range(repeats + 2):
                    if phase == "asleep":
                        spin(busy)
                    t0, c0 = time.perf_counter(), cpu_time()
                    links.send(0, ExpertInput(LayerKey(0, 0, 0), 0, *msg))
                    c1 = cpu_time()
                    links.recv(0, 30.0).release()
                    if i >= 2 and phase in t_rtt:
                        t_rtt[phase].append(time.perf_counter() - t0)
                        t_send[phase].append(c1 - c0)
            mine.append((fwd, back, {k: statistics.median(v) for k, v in t_rtt.items()},
                         {k: statistics.median(v) for k, v in t_send.items()}))
        msg = links.recv(0, 30.0)  # the peer's timings (not a data-plane message: the comm layer's own)
        peer_rows = msg.tensors[0].tolist()
        msg.release()
        links.comm.send("expert", [torch.zeros(1)])  # goodbye
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
        del store
    if proc.returncode != 0:
        raise RuntimeError(f"transport peer exited with code {proc.returncode}")
    return res
