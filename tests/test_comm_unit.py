"""afdserve.comm: header codec, config validation, API errors (single process, threads)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from afdserve.comm import (
    MAX_META_INTS,
    MAX_TENSORS,
    CommConfig,
    Communicator,
    ConnectError,
    Meta,
    PayloadTooLargeError,
    PeerClosedError,
    PeerTimeoutError,
    SlotBusyError,
    list_segments,
    payload_nbytes,
)
from afdserve.comm.header import HEADER_BYTES, decode, encode_into, plan
from afdserve.errors import ConfigError

TRANSPORTS = ["shm", "tcp", "torch"]


def pair(transport: str, group: str, **cfg) -> tuple[Communicator, Communicator]:
    """Sender 'a' -> receiver 'b' connected in two threads (connect blocks until both sides meet)."""
    store = dist.HashStore()
    config = CommConfig(transport=transport, connect_timeout_s=20, **cfg)
    out: dict[str, Communicator] = {}
    errs: list[BaseException] = []

    def mk(name: str, **kw) -> None:
        try:
            out[name] = Communicator(name, store, config, group=group).connect(**kw)
        except BaseException as e:  # pragma: no cover - surfaced below
            errs.append(e)

    ts = [threading.Thread(target=mk, args=("a",), kwargs={"send_to": ["b"]}, daemon=True),
          threading.Thread(target=mk, args=("b",), kwargs={"recv_from": ["a"]}, daemon=True)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    if errs:
        raise errs[0]
    return out["a"], out["b"]


def test_header_roundtrip_all_dtypes():
    from afdserve.comm.header import CODE_OF

    tensors = [torch.zeros((2, 3), dtype=dt) for dt in list(CODE_OF)[:MAX_TENSORS]]
    descs, total = plan(tensors, 1 << 20, "p")
    assert total == payload_nbytes(tensors) == payload_nbytes([(t.shape, t.dtype) for t in tensors])
    buf = bytearray(HEADER_BYTES)
    meta = Meta(step=-3, microbatch=7, layer=31, num_tokens=1 << 40, tag=-1, ints=tuple(range(MAX_META_INTS)))
    encode_into(buf, 0, 12345, meta, descs, total)
    h = decode(buf)
    assert h.seq == 12345 and h.payload_bytes == total and h.meta == meta
    assert [(d.dtype, d.shape, d.offset, d.nbytes) for d in h.tensors] == [
        (d.dtype, d.shape, d.offset, d.nbytes) for d in descs]
    assert all(d.offset % 64 == 0 for d in descs)


def test_header_limits():
    with pytest.raises(PayloadTooLargeError, match="at most"):
        plan([torch.zeros(1)] * (MAX_TENSORS + 1), 1 << 20, "p")
    with pytest.raises(PayloadTooLargeError, match="dims"):
        plan([torch.zeros([1] * 7)], 1 << 20, "p")
    with pytest.raises(PayloadTooLargeError, match="slot capacity of 100 bytes"):
        plan([torch.zeros(100, dtype=torch.uint8), torch.zeros(1)], 100, "p")
    with pytest.raises(PayloadTooLargeError):
        encode_into(bytearray(HEADER_BYTES), 0, 0, Meta(ints=(0,) * (MAX_META_INTS + 1)), [], 0)
    with pytest.raises(ValueError, match="corrupt"):
        decode(bytearray(HEADER_BYTES))


@pytest.mark.parametrize("field,value", [("num_slots", 0), ("num_slots", 65), ("slot_bytes", -1),
                                         ("transport", "rdma"), ("deadline_s", 0), ("torch_backend", "mpi")])
def test_config_validation(field, value):
    with pytest.raises(ConfigError, match=field):
        CommConfig(**{field: value})


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_api_basics(transport):
    a, b = pair(transport, f"basics-{transport}", slot_bytes=4096, num_slots=2, deadline_s=5)
    try:
        assert a.transport("b") == transport and b.transport("a", "recv") == transport
        assert a.capacity("b") == 4096
        x = torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, 1:]  # non-contiguous
        a.send("b", [x, torch.tensor(5, dtype=torch.int64), torch.empty(0, 7)], Meta(microbatch=3, ints=(9,)))
        a.send("b", (), Meta(layer=2))  # metadata only
        with b.recv("a") as m:
            assert m.peer == "a" and m.seq == 0 and m.meta.microbatch == 3 and m.meta.ints == (9,)
            assert torch.equal(m.tensors[0], x) and m.tensors[1].item() == 5 and m.tensors[2].shape == (0, 7)
        m2 = b.recv("a")
        assert m2.tensors == [] and m2.meta.layer == 2 and m2.payload_bytes == 0
        a.send("b", torch.ones(1))
        m3 = b.recv("a")  # slot 0; m2 still holds slot 1, which message #3 would need
        with pytest.raises(SlotBusyError, match="slot 1"):
            b.recv("a")
        m2.release()
        m2.release()  # idempotent
        m3.release()
        with pytest.raises(PayloadTooLargeError, match="4096"):
            a.send("b", torch.zeros(4097, dtype=torch.uint8))
        with pytest.raises(PeerTimeoutError, match="'a'") as ei:
            b.recv("a", timeout=0.05)
        assert ei.value.peer == "a"
        with pytest.raises(ValueError, match="no send channel"):
            a.send("zz", torch.ones(1))
    finally:
        a.close()
        b.close()
    assert a.closed and b.closed


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_send_blocks_only_when_slots_are_full(transport):
    a, b = pair(transport, f"credits-{transport}", slot_bytes=64, num_slots=3, deadline_s=5)
    try:
        for i in range(3):
            a.send("b", torch.full((4,), i))
        with pytest.raises(PeerTimeoutError, match="slots still held"):
            a.send("b", torch.ones(4), timeout=0.05)
        msgs = [b.recv("a") for _ in range(3)]
        msgs[1].release()  # out-of-order release frees slot 1 only; the next message needs slot 0
        with pytest.raises(PeerTimeoutError):
            a.send("b", torch.ones(4), timeout=0.05)
        msgs[0].release()
        a.send("b", torch.full((4,), 3))
        assert b.recv("a").tensors[0][0].item() == 3
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_orderly_close_gives_peer_closed(transport):
    a, b = pair(transport, f"close-{transport}", slot_bytes=64, num_slots=2, deadline_s=2)
    a.send("b", torch.ones(2))
    a.close()
    with b.recv("a") as m:  # data sent before the close is still delivered
        assert m.tensors[0].sum().item() == 2
    with pytest.raises(PeerClosedError, match="'a'"):
        b.recv("a")
    b.close()


def test_transport_mismatch_and_missing_peer():
    store = dist.HashStore()
    errs: list[BaseException] = []

    def mk(name, transport, **kw):
        try:
            Communicator(name, store, CommConfig(transport=transport, connect_timeout_s=5),
                         group="mismatch").connect(**kw)
        except BaseException as e:
            errs.append(e)

    ts = [threading.Thread(target=mk, args=("a", "tcp"), kwargs={"send_to": ["b"]}),
          threading.Thread(target=mk, args=("b", "shm"), kwargs={"recv_from": ["a"]})]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert len(errs) == 2 and all(isinstance(e, ConnectError) for e in errs)
    with pytest.raises(ConnectError, match="'ghost'"):
        Communicator("lonely", store, CommConfig(connect_timeout_s=0.3), group="missing").connect(send_to=["ghost"])


def test_auto_picks_shm_on_one_machine_and_segments_are_unlinked():
    import os

    a, b = pair("auto", "auto-pick", slot_bytes=1 << 16, num_slots=2)
    try:
        assert a.transport("b") == "shm"
        mine = [s for s in list_segments() if s.startswith(f"afd_{os.getpid()}_")]
        assert mine == []  # unlinked as soon as the sender mapped it
    finally:
        a.close()
        b.close()


def test_mixed_transports_in_one_communicator_and_recv_any():
    """A receiver whose senders use different transports (a forced tcp peer, an auto = shm peer)."""
    store = dist.HashStore()
    out: dict[str, Communicator] = {}

    def mk(name, transport, **kw):
        out[name] = Communicator(name, store, CommConfig(transport=transport, slot_bytes=256, deadline_s=5),
                                 group="mixed").connect(**kw)

    ts = [threading.Thread(target=mk, args=("s0", "tcp"), kwargs={"send_to": ["r"]}),
          threading.Thread(target=mk, args=("s1", "auto"), kwargs={"send_to": ["r"]}),
          threading.Thread(target=mk, args=("r", "auto"), kwargs={"recv_from": ["s0", "s1"]})]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    r = out["r"]
    try:
        assert r.transport("s0", "recv") == "tcp" and r.transport("s1", "recv") == "shm"
        out["s1"].send("r", torch.tensor([1]))
        out["s0"].send("r", torch.tensor([0]))
        got = set()
        for _ in range(2):
            with r.recv_any() as m:
                got.add((m.peer, m.tensors[0].item()))
        assert got == {("s0", 0), ("s1", 1)}
        with pytest.raises(PeerTimeoutError) as ei:
            r.recv_any(timeout=0.02)
        assert set(ei.value.peers) == {"s0", "s1"}
    finally:
        for c in out.values():
            c.close()


def test_a_shared_memory_wait_sleeps_on_the_futex():
    """A receiver blocked on a shared-memory pair announces a futex sleep (a socket wake-up would pull
    it onto the sender's core), and a send wakes it."""
    import time

    from afdserve.comm.doorbell import _W_WAITING, FUTEX
    from afdserve.comm.shm_transport import ShmRecvChannel, ShmSendChannel

    assert ShmRecvChannel.futex_ok and ShmSendChannel.futex_ok
    a, b = pair("shm", "futex-wait", spin_s=0.0)
    got: list = []
    t = threading.Thread(target=lambda: got.append(b.recv("a", timeout=20)))
    t.start()
    bell = b._links.bell
    deadline = time.monotonic() + 20
    while bell._w[_W_WAITING] != FUTEX and time.monotonic() < deadline:  # the waiting word, once it sleeps
        pass
    assert bell._w[_W_WAITING] == FUTEX
    a.send("b", torch.arange(3))
    t.join(20)
    assert torch.equal(got[0].tensors[0], torch.arange(3))
    got[0].release()
    a.close()
    b.close()


@pytest.mark.parametrize("yielding", [False, True])
def test_a_wait_does_not_spin_while_told_not_to(yielding):
    """``Progress.no_spin``: a wait whose core is wanted elsewhere sleeps at once instead of spinning
    on it, and that is not a failed spin (the budget stays)."""
    from afdserve.comm.progress import _now, Progress

    p = Progress(spin_s=10.0)  # a spin would last until the deadline
    p._waits = 1  # not a probe wait
    p.no_spin = (lambda: True) if yielding else None
    calls = [0]

    def ready() -> bool:
        calls[0] += 1
        return False

    with pytest.raises(TimeoutError):
        p.wait(ready, lambda: None, _now() + 0.05, lambda: TimeoutError("late"))
    if yielding:
        assert calls[0] < 100 and p._spin == 10.0  # a check per sleep of at most BLOCK_CHUNK_S
    else:
        assert calls[0] > 1000  # spun until the deadline
