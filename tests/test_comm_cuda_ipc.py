"""The CUDA IPC transport (``comm/cuda_ipc.py``): the shared-memory protocol with the payload in the
receiver's device memory.

On the CPU: the handshake's choice and its fallback reasons, the fallbacks' plumbing (a receiver whose
device slots cannot be exported, a sender that cannot open them), the configuration's validation,
and the shm protocol through ``DevicePayload`` on CPU memory with logging stand-ins for the streams
and events (where each wait and record falls relative to the FILLED / FREED words).

With CUDA (skipped without): the real transport between two processes -- payloads across many
messages with slot reuse, ordering on the GPU with no host sync (long kernels before the copy and
before the read keep the streams busy: a missing event wait would read stale or overwritten data),
and a dead peer on either side.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing as mp
import os
import threading
import traceback

import pytest
import torch
import torch.distributed as dist

from afdserve.comm import CommConfig, Communicator, ConnectError, Meta, PeerClosedError, PeerDeadError
from afdserve.comm import cuda_ipc
from afdserve.comm.handshake import choose_transport
from afdserve.errors import ConfigError

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA device")


# -- CPU ---------------------------------------------------------------------------------------------
def test_choice_and_why_not():
    g0, g1 = "GPU-0", "GPU-1"
    assert choose_transport("auto", "auto", True, "p", g0, g1) == ("cuda_ipc", True, None)
    assert choose_transport("auto", "auto", True, "p") == ("shm", True, None)  # no GPU: nothing to explain
    t, fb, why = choose_transport("auto", "auto", True, "p", None, g1)
    assert (t, fb) == ("shm", True) and "sender" in why
    t, fb, why = choose_transport("auto", "auto", True, "p", g0, None)
    assert (t, fb) == ("shm", True) and "receiver" in why
    t, fb, why = choose_transport("auto", "auto", False, "p", g0, g1)
    assert (t, fb) == ("tcp", True) and "different machines" in why
    assert choose_transport("cuda_ipc", "auto", True, "p", g0, g0) == ("cuda_ipc", False, None)
    assert choose_transport("auto", "shm", True, "p", g0, g1) == ("shm", False, None)  # forced shm stays
    with pytest.raises(ConnectError, match="cuda_ipc with peer 'p' impossible: the receiver"):
        choose_transport("auto", "cuda_ipc", True, "p", g0, None)
    with pytest.raises(ConnectError, match="different machines"):
        choose_transport("cuda_ipc", "cuda_ipc", False, "p", g0, g1)


def test_config_needs_a_cuda_device():
    with pytest.raises(ConfigError, match="device"):
        CommConfig(transport="cuda_ipc")
    with pytest.raises(ConfigError, match="device"):
        CommConfig(transport="cuda_ipc", device="cpu")
    assert CommConfig(transport="cuda_ipc", device="cuda:1").device == "cuda:1"
    assert CommConfig(transport="shm", device="cpu").device == "cpu"
    if not torch.cuda.is_available():
        assert cuda_ipc.gpu_uuid("cuda") is None and cuda_ipc.gpu_uuid("cpu") is None


def _pair(group: str, transport: str = "auto", **cfg):
    """Sender 'a' -> receiver 'b' in two threads; returns (communicators, errors)."""
    store = dist.HashStore()
    out: dict[str, Communicator] = {}
    errs: list[BaseException] = []

    def mk(name, **kw):
        try:
            c = CommConfig(transport=transport, device="cuda", slot_bytes=4096, num_slots=2, deadline_s=5,
                           connect_timeout_s=10, **cfg)
            out[name] = Communicator(name, store, c, group=group).connect(**kw)
        except BaseException as e:
            errs.append(e)

    ts = [threading.Thread(target=mk, args=("a",), kwargs={"send_to": ["b"]}),
          threading.Thread(target=mk, args=("b",), kwargs={"recv_from": ["a"]})]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return out, errs


def _exchange(a: Communicator, b: Communicator) -> None:
    for k in range(5):  # more messages than slots
        a.send("b", [torch.full((3, k + 1), float(k))], Meta(step=k))
        with b.recv("a") as m:
            assert m.meta.step == k and torch.equal(m.tensors[0], torch.full((3, k + 1), float(k)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the failures below are those of a machine without CUDA")
def test_fallbacks_to_shared_memory_with_a_logged_reason(monkeypatch, caplog):
    """Both ends claim a GPU (their UUID), but none works here: the receiver cannot export its device
    slots, then (with an export that hands out slots) the sender cannot open them; either way the
    pair runs on shared memory and the log says why. Forced cuda_ipc fails on both sides instead."""
    monkeypatch.setattr(cuda_ipc, "gpu_uuid", lambda device: "GPU-test")
    caplog.set_level(logging.INFO, logger="afdserve.comm")
    out, errs = _pair("ipc-export-fails")
    assert not errs, errs
    assert out["a"].transport("b") == out["b"].transport("a", "recv") == "shm"
    assert "a>b: transport shm instead of cuda_ipc: device slots could not be exported" in caplog.text
    _exchange(out["a"], out["b"])
    for c in out.values():
        c.close()

    def export(device, num_slots, slot_bytes):  # slots in host memory: the sender has no CUDA to open them
        mem = torch.zeros(num_slots * 8192, dtype=torch.uint8)
        return cuda_ipc.DevicePayload(mem, num_slots, slot_bytes, [], []), {"uuid": "GPU-test", "probe": 1}

    monkeypatch.setattr(cuda_ipc, "export", export)
    caplog.clear()
    out, errs = _pair("ipc-open-fails")
    assert not errs, errs
    assert out["a"].transport("b") == out["b"].transport("a", "recv") == "shm"
    assert caplog.text.count("cannot open its CUDA IPC slots: CUDA is not available") == 2  # both ends log it
    _exchange(out["a"], out["b"])
    for c in out.values():
        c.close()

    out, errs = _pair("ipc-forced", transport="cuda_ipc")
    assert len(errs) == 2 and all(isinstance(e, ConnectError) for e in errs), errs
    assert any("cuda_ipc" in str(e) for e in errs)


class _Stream:
    def __init__(self, log: list) -> None:
        self.log = log

    def wait_event(self, ev) -> None:
        self.log.append(("wait", ev.name, ev.word()))


class _Event:
    """Stands for an interprocess CUDA event: logs each record with the completion word it guards
    (FILLED or FREED of its slot) as it is at that moment."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log
        self.word = lambda: -1

    def record(self, stream) -> None:
        self.log.append(("record", self.name, self.word()))


def test_the_shm_protocol_through_the_device_strategy(monkeypatch):
    """The real handshake and shm protocol with ``DevicePayload`` on CPU memory: only the CUDA parts
    (the IPC export/open, the probe, streams and events) are replaced, by ones that log. Per message
    in slot s: a reused slot's copy waits on freed[s] recorded by the receiver's release of the
    slot's last message; filled[s] is recorded before FILLED is stored, freed[s] before FREED; the
    receiver waits on filled[s] before it gets the tensors. A send after the receiver closed fails
    before it touches the receiver's memory."""
    from afdserve.comm.shm_transport import C_FILLED, C_FREED
    from afdserve.comm.slots import slot_stride

    log: list = []
    slots = 2
    events = [_Event(f"{kind}{s}", log) for kind in ("filled", "freed") for s in range(slots)]
    shared: dict = {}

    def export(device, num_slots, slot_bytes):
        shared["mem"] = torch.zeros(num_slots * slot_stride(slot_bytes), dtype=torch.uint8)
        return cuda_ipc.DevicePayload(shared["mem"], num_slots, slot_bytes, events[:slots], events[slots:]), \
            {"uuid": "GPU-test", "probe": 0}

    def open_peer(ipc, num_slots, slot_bytes):
        return cuda_ipc.DevicePayload(shared["mem"], num_slots, slot_bytes, events[:slots], events[slots:])

    monkeypatch.setattr(cuda_ipc, "gpu_uuid", lambda device: "GPU-test")
    monkeypatch.setattr(cuda_ipc, "export", export)
    monkeypatch.setattr(cuda_ipc, "open_peer", open_peer)
    monkeypatch.setattr(cuda_ipc, "probe_sender", lambda payload, probe: None)
    monkeypatch.setattr(cuda_ipc, "probe_receiver", lambda payload, probe: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(log))
    out, errs = _pair("ipc-protocol")  # two slots
    assert not errs, errs
    a, b = out["a"], out["b"]
    assert a.transport("b") == b.transport("a", "recv") == "cuda_ipc"
    ctl = a._links.send["b"].ctl
    for s in range(slots):
        events[s].word = lambda s=s: int(ctl[C_FILLED + s])
        events[slots + s].word = lambda s=s: int(ctl[C_FREED + s])
    for k in range(7):
        s = k % slots
        del log[:]
        a.send("b", [torch.full((5, k + 1), float(k)), torch.arange(k)], Meta(step=k))
        sent = list(log)
        m = b.recv("a")
        got = log[len(sent):]
        assert torch.equal(m.tensors[0], torch.full((5, k + 1), float(k)))
        assert torch.equal(m.tensors[1], torch.arange(k))
        del log[:]
        m.release()
        before = k - slots + 1 if k >= slots else 0  # the slot's words before this message
        # a reused slot waits for the release of its last message (its FREED already stored) ...
        assert sent == ([("wait", f"freed{s}", before)] if k >= slots else []) + [("record", f"filled{s}", before)]
        assert got == [("wait", f"filled{s}", k + 1)]  # ... the receiver waits after FILLED, before the views
        assert log == [("record", f"freed{s}", before)]  # the release records before FREED = k + 1
        assert int(ctl[C_FREED + s]) == k + 1
    b.close()
    del log[:]
    with pytest.raises(PeerClosedError):  # a free slot, but the receiver's memory is gone: seen before any copy
        a.send("b", [torch.ones(3)])
    assert log == []
    a.close()


# -- CUDA: two processes -----------------------------------------------------------------------------
SLOTS = 3
MANY = 150
ORDERED = 30
SLEEP_CYCLES = 200_000_000  # ~0.1 s of a GPU's clock: streams are still busy when the host checks


def _message(k: int, dev: torch.device) -> list[torch.Tensor]:
    rows = (k * 7) % 33
    x = torch.arange(rows * 64, device=dev, dtype=torch.float32).view(rows, 64) + k
    ids = torch.arange(rows, device=dev, dtype=torch.int64) * (k + 1)
    w = (torch.arange(3 * rows, device=dev, dtype=torch.float32).view(3, rows) / (k + 1)).to(torch.bfloat16)
    return [x, ids, w]


def _config(**kw) -> CommConfig:
    return CommConfig(**({"transport": "cuda_ipc", "device": "cuda:0", "slot_bytes": 64 << 10, "num_slots": SLOTS,
                          "deadline_s": 30.0, "connect_timeout_s": 60.0} | kw))


def _child(scenario: str, host: str, port: int, q) -> None:
    """The sender, except in 'dead_receiver' (where it is the receiver that dies)."""
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))
        dev = torch.device("cuda:0")
        if scenario == "dead_receiver":
            comm = Communicator("b", store, _config(num_slots=2), group=scenario).connect(recv_from=["a"])
            q.put(("connected", comm.transport("a", "recv")))
            comm.recv("a", timeout=30).release()
            os._exit(0)  # no goodbye: the socket's EOF is all the sender learns
        comm = Communicator("a", store, _config(num_slots=1 if scenario == "order" else SLOTS),
                            group=scenario).connect(send_to=["b"])
        q.put(("connected", comm.transport("b")))
        busy = []
        for k in range(MANY if scenario == "many" else ORDERED):
            if scenario == "order":
                if k % 3 == 0:
                    torch.cuda._sleep(SLEEP_CYCLES)  # the payload is written after a long kernel ...
                x = torch.full((1024,), float(k), device=dev)
                comm.send("b", [x], Meta(step=k))  # ... and sent at once: the copy queues behind it
                if k % 3 == 0:
                    busy.append(not torch.cuda.current_stream(dev).query())
            else:
                comm.send("b", _message(k, dev), Meta(step=k, num_tokens=k))
            if scenario == "dead_sender" and k == 1:
                torch.cuda.synchronize(dev)  # its copies are done: only the process goes away
                os._exit(0)
        torch.cuda.synchronize(dev)
        q.put(("done", busy))
        store.wait(["closed"], datetime.timedelta(seconds=60))
        comm.close()
    except BaseException:
        q.put(("error", traceback.format_exc()))


@contextlib.contextmanager
def _run(scenario: str):
    """The child of ``scenario`` (``_child``) started, with its store and queue; killed on the way
    out if it is still alive."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(scenario, store.host, store.port, q), daemon=True)
    p.start()
    try:
        yield store, p, q
    finally:
        if p.is_alive():
            p.kill()


def _close(store, p, comm) -> None:
    """The orderly end: the child is told to close and exits cleanly, then ``comm`` closes."""
    store.set("closed", "1")
    p.join(60)
    assert p.exitcode == 0
    comm.close()


def _get(q, what: str, timeout: float = 120.0):
    tag, val = q.get(timeout=timeout)
    assert tag == what, f"child: {tag}\n{val}"
    return val


@needs_cuda
def test_many_messages_reuse_the_device_slots():
    with _run("many") as (store, p, q):
        b = Communicator("b", store, _config(), group="many").connect(recv_from=["a"])
        assert b.transport("a", "recv") == "cuda_ipc" and _get(q, "connected") == "cuda_ipc"
        dev = torch.device("cuda:0")
        for k in range(MANY):
            with b.recv("a", timeout=30) as m:
                assert m.seq == k and m.meta.step == k and m.meta.num_tokens == k
                want = _message(k, dev)
                assert [t.device.type for t in m.tensors] == ["cuda"] * 3
                assert [(t.dtype, t.shape) for t in m.tensors] == [(t.dtype, t.shape) for t in want]
                assert all(torch.equal(g, w) for g, w in zip(m.tensors, want)), k
        _get(q, "done")
        _close(store, p, b)


@needs_cuda
def test_ordering_on_the_gpu_without_host_sync():
    """One slot, long kernels: message 3j is written by the sender after a long kernel and read by the
    receiver at once (only the filled event keeps the read after the copy); message 3j+1 is read
    after a long kernel on the receiver and 3j+2 is sent at once (only the freed event keeps its copy
    into the one slot after that read). Neither side synced: its stream was still running the long
    kernel when send / release returned."""
    with _run("order") as (store, p, q):
        b = Communicator("b", store, _config(num_slots=1), group="order").connect(recv_from=["a"])
        assert _get(q, "connected") == "cuda_ipc"
        dev = torch.device("cuda:0")
        stream = torch.cuda.current_stream(dev)
        got, busy = [], []
        for k in range(ORDERED):
            m = b.recv("a", timeout=30)
            if k % 3 == 1:
                torch.cuda._sleep(SLEEP_CYCLES)  # the read below queues behind a long kernel ...
            got.append(m.tensors[0].clone())
            m.release()  # ... and the slot is handed back at once (its freed event after the clone)
            if k % 3 == 1:
                busy.append(not stream.query())
        torch.cuda.synchronize(dev)
        assert [g.unique().tolist() for g in got] == [[float(k)] for k in range(ORDERED)]
        sender_busy = _get(q, "done")
        assert all(sender_busy) and all(busy) and len(busy) == ORDERED // 3, (sender_busy, busy)
        _close(store, p, b)


@needs_cuda
def test_a_dead_sender_is_noticed_after_its_messages():
    with _run("dead_sender") as (store, p, q):
        b = Communicator("b", store, _config(), group="dead_sender").connect(recv_from=["a"])
        assert _get(q, "connected") == "cuda_ipc"
        dev = torch.device("cuda:0")
        for k in range(2):
            with b.recv("a", timeout=30) as m:
                assert all(torch.equal(g, w) for g, w in zip(m.tensors, _message(k, dev)))
        p.join(60)
        with pytest.raises(PeerDeadError, match="'a'"):
            b.recv("a", timeout=30)
        assert torch.ones(4, device=dev).sum().item() == 4  # this process's CUDA is unharmed
        b.close()


@needs_cuda
def test_a_dead_receiver_fails_the_sender_not_its_gpu():
    with _run("dead_receiver") as (store, p, q):
        a = Communicator("a", store, _config(num_slots=2), group="dead_receiver").connect(send_to=["b"])
        assert a.transport("b") == "cuda_ipc" and _get(q, "connected") == "cuda_ipc"
        dev = torch.device("cuda:0")
        a.send("b", _message(1, dev))
        p.join(60)
        assert p.exitcode == 0
        with pytest.raises(PeerDeadError, match="'b'"):  # a slot is free, but the socket's EOF is seen first:
            a.send("b", _message(2, dev), timeout=30)       # nothing is copied into the dead process's memory
        assert torch.ones(4, device=dev).sum().item() == 4
        a.close()
