"""Faults: a peer that stalls or is killed mid-exchange makes the waiting side raise the specific
error, naming the peer, within the deadline (the default, 200 ms); nothing hangs; /dev/shm stays
clean. The peer runs in a process started with multiprocessing 'spawn'; this test process is the
other end.

No fixed wall-clock limits: a stall must end in PeerTimeoutError no sooner than the deadline (same
clock as the library's) and well before ``LATE``; a death must end in PeerDeadError, which the waits
raise only when they notice the death before their deadline (a death noticed late is a timeout).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from afdserve.comm import (
    CommConfig,
    Communicator,
    ConnectError,
    PeerDeadError,
    PeerTimeoutError,
    list_segments,
    sweep_shm,
)

from polling import wait_until

DEADLINE = CommConfig().deadline_s  # the library's default once a step has started: the waits below use it
# "within the deadline": a wait that ignored it would block until the peer's own 60 s timeouts; a
# loaded 2-core machine delays a wake-up by far less than this
LATE = 10 * DEADLINE
BIG = 2 << 20
_now = time.perf_counter  # the library's clock for deadlines


def _at_the_deadline(took: float, transport: str) -> bool:
    """A wait that timed out did so at the deadline: not before it (torch.distributed truncates its
    timeouts to whole milliseconds), and not ``LATE``."""
    return DEADLINE - (1e-3 if transport == "torch" else 0.0) <= took < LATE


def _peer(role: str, transport: str, host: str, port: int, resume, state) -> None:
    """role 'send': send 2 messages, stall until `resume`, then stream big messages forever.
    role 'recv': take and release 2 messages, stall until `resume`, then take and release forever.
    ``state``: -1 failed, else 1 + the messages taken after ``resume`` (role 'recv')."""
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))
        cfg = CommConfig(transport=transport, slot_bytes=BIG, num_slots=2, deadline_s=60, connect_timeout_s=60)
        comm = Communicator("peer", store, cfg, group=f"fault-{role}-{transport}")
        if role == "send":
            comm.connect(send_to=["main"])
            x = torch.ones(BIG // 4)
            for _ in range(2):
                comm.send("main", x)
            state.value = 1
            resume.wait(60)
            while True:
                comm.send("main", x, timeout=60)
        else:
            comm.connect(recv_from=["main"])
            for _ in range(2):
                comm.recv("main", timeout=60).release()
            state.value = 1
            resume.wait(60)
            while True:
                comm.recv("main", timeout=60).release()
                state.value += 1
    except BaseException:
        traceback.print_exc()
        state.value = -1


def _start(role: str, transport: str):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    resume, state = ctx.Event(), ctx.Value("i", 0)
    p = ctx.Process(target=_peer, args=(role, transport, store.host, store.port, resume, state), daemon=True)
    p.start()
    return store, p, resume, state


def _wait_state(state, p, value=1, timeout=60.0) -> None:
    """Waits until the peer's ``state`` reaches ``value`` (it fails or dies: assertion)."""
    wait_until(lambda: state.value >= value or state.value < 0 or not p.is_alive(), timeout)
    assert state.value >= value, f"peer process failed (state {state.value}, alive {p.is_alive()})"


def _assert_no_segments(*pids: int) -> None:
    left = [s for s in list_segments() if any(s.startswith(f"afd_{pid}_") for pid in pids)]
    assert not left, left


@pytest.mark.parametrize("transport", ["shm", "tcp", "torch"])
def test_sender_stalls_then_dies_mid_exchange(transport):
    store, p, resume, state = _start("send", transport)
    comm = None
    try:
        cfg = CommConfig(transport=transport, slot_bytes=BIG, num_slots=2, connect_timeout_s=60)
        comm = Communicator("main", store, cfg, group=f"fault-send-{transport}").connect(recv_from=["peer"])
        for _ in range(2):
            comm.recv("peer", timeout=30).release()
        _wait_state(state, p)

        # stalled peer: PeerTimeoutError naming it, at the deadline (not before), not late
        t0 = _now()
        with pytest.raises(PeerTimeoutError) as ei:
            comm.recv("peer")
        took = _now() - t0
        assert ei.value.peer == "peer" and _at_the_deadline(took, transport), took

        if transport == "torch":  # a timed-out torch.distributed wait leaves the pair unusable (documented)
            p.kill()
            return
        # killed in the middle of streaming 2 MiB messages: PeerDeadError (noticed within a recv's
        # deadline: one that ran out first would raise PeerTimeoutError)
        resume.set()
        for _ in range(3):
            comm.recv("peer", timeout=30).release()
        os.kill(p.pid, signal.SIGKILL)
        with pytest.raises(PeerDeadError) as ei:
            while True:  # messages completed before the kill are still delivered
                comm.recv("peer").release()
        assert ei.value.peer == "peer"
    finally:
        if comm is not None:
            comm.close()
        p.kill()
        p.join(10)
    _assert_no_segments(os.getpid(), p.pid)


@pytest.mark.parametrize("transport", ["shm", "tcp", "torch"])
def test_receiver_dies_while_sender_waits_for_a_slot(transport):
    store, p, resume, state = _start("recv", transport)
    comm = None
    try:
        cfg = CommConfig(transport=transport, slot_bytes=BIG, num_slots=2, connect_timeout_s=60)
        comm = Communicator("main", store, cfg, group=f"fault-recv-{transport}").connect(send_to=["peer"])
        x = torch.ones(BIG // 4)
        for _ in range(2):
            comm.send("peer", x, timeout=30)
        _wait_state(state, p)
        if transport != "torch":  # receiver holds nothing but stalls: both slots fill, then a timeout
            for _ in range(2):
                comm.send("peer", x)
            t0 = _now()
            with pytest.raises(PeerTimeoutError) as ei:
                comm.send("peer", x)
            took = _now() - t0
            assert ei.value.peer == "peer" and _at_the_deadline(took, transport), took
            resume.set()
            taken = 2  # the two that filled the slots
        else:
            resume.set()
            for _ in range(4):
                comm.send("peer", x, timeout=30)
            taken = 4
        _wait_state(state, p, 1 + taken)  # the peer took everything: it now waits in recv
        os.kill(p.pid, signal.SIGKILL)
        # PeerDeadError: noticed within a send's deadline (a send that ran out first raises PeerTimeoutError)
        with pytest.raises(PeerDeadError) as ei:
            for _ in range(100):
                comm.send("peer", x)
        assert ei.value.peer == "peer"
    finally:
        if comm is not None:
            comm.close()
        p.kill()
        p.join(10)
    _assert_no_segments(os.getpid(), p.pid)


def _make_segment_and_hang(state) -> None:
    from afdserve.comm.shm import Segment

    Segment.create(1 << 16)
    state.value = 1
    time.sleep(60)


def test_sweep_removes_segments_of_a_crashed_creator():
    """A receiver killed between creating its segment and the sender's ack (a tiny window during
    connect) leaves its segment behind; sweep_shm() (what a launcher calls) removes it."""
    ctx = mp.get_context("spawn")
    state = ctx.Value("i", 0)
    p = ctx.Process(target=_make_segment_and_hang, args=(state,), daemon=True)
    p.start()
    try:
        _wait_state(state, p)
        assert [s for s in list_segments() if s.startswith(f"afd_{p.pid}_")]
        removed = sweep_shm()  # the creator still runs: its segment must survive a sweep
        assert not any(s.startswith(f"afd_{p.pid}_") for s in removed)
        assert [s for s in list_segments() if s.startswith(f"afd_{p.pid}_")]
        p.kill()
        p.join(10)
        removed = sweep_shm()
        assert any(s.startswith(f"afd_{p.pid}_") for s in removed)
    finally:
        p.kill()
        p.join(10)
    _assert_no_segments(p.pid)


def test_peer_that_never_connects_fails_connect_in_time():
    store = dist.HashStore()
    cfg = CommConfig(connect_timeout_s=0.5)
    t0 = _now()
    with pytest.raises(ConnectError, match="'ghost'"):
        Communicator("main", store, cfg, group="ghost").connect(recv_from=["ghost"])
    took = _now() - t0
    assert cfg.connect_timeout_s <= took < 10 * cfg.connect_timeout_s, took  # at its timeout, not late
    _assert_no_segments(os.getpid())
