"""Property: random M x N groups (<= 4 x 4), random per-pair payloads (zero bytes included), many
rounds with several slots in flight and out-of-order releases: every byte arrives intact and in
order per pair, on every transport. Endpoints run as threads here; test_comm_multiproc.py runs
the same exchange across processes."""

from __future__ import annotations

import random
import socket
import threading
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afdserve.comm import CommConfig, Communicator, Meta, PeerError, PeerTimeoutError
from afdserve.comm.tcp_transport import TcpRecvChannel

DTYPES = [torch.uint8, torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16]


def message_for(i: int, j: int, r: int, max_bytes: int, seed: int) -> list[torch.Tensor]:
    """The deterministic payload sender i sends to receiver j in round r (0-3 tensors, maybe empty)."""
    rng = random.Random(hash((seed, i, j, r)))
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    out = []
    budget = max_bytes
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        dt = rng.choice(DTYPES)
        el = torch.empty((), dtype=dt).element_size()
        n = rng.choice([0, 1, rng.randrange(0, max(1, budget // el // 2) + 1)])
        budget -= n * el + 64
        if budget < 0:
            break
        shape = (n,) if n % 3 else (n // 3, 3) if n else (0, rng.randrange(1, 4))
        raw = torch.randint(0, 256, (n * el,), dtype=torch.uint8, generator=g)
        t = raw.view(dt).reshape(shape) if dt != torch.bool else (raw % 2).view(torch.bool).reshape(shape)
        out.append(t)
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def run_exchange(transport: str, m: int, n: int, rounds: int, slots: int, hold: int, max_bytes: int,
                 use_any: bool, seed: int, group: str, timeout: float = 60.0) -> None:
    store = dist.HashStore()
    cfg = CommConfig(transport=transport, slot_bytes=max_bytes + 64 * 3, num_slots=slots, deadline_s=20.0,
                     connect_timeout_s=15.0)
    senders = [f"s{i}" for i in range(m)]
    receivers = [f"r{j}" for j in range(n)]
    errors: list[BaseException] = []
    comms: list[Communicator] = []
    lock = threading.Lock()

    def sender(i: int) -> None:
        comm = Communicator(senders[i], store, cfg, group=group)
        with lock:
            comms.append(comm)
        comm.connect(send_to=receivers)
        rng = random.Random(seed * 7 + i)
        for r in range(rounds):
            order = list(range(n))
            rng.shuffle(order)
            for j in order:
                comm.send(receivers[j], message_for(i, j, r, max_bytes, seed),
                          Meta(step=r, microbatch=r % slots, layer=i, num_tokens=j, ints=(i, j, r)))

    def receiver(j: int) -> None:
        comm = Communicator(receivers[j], store, cfg, group=group)
        with lock:
            comms.append(comm)
        comm.connect(recv_from=senders)
        rng = random.Random(seed * 11 + j)
        expect = {s: 0 for s in senders}
        held: dict[str, list] = {s: [] for s in senders}
        keep = min(hold, slots - 1)
        for _ in range(rounds * m):
            if use_any:
                cands = [s for s in senders if expect[s] < rounds]
                msg = comm.recv_any(cands)
            else:
                s = min(senders, key=lambda s: (expect[s], s))
                msg = comm.recv(s)
            s = msg.peer
            i, r = senders.index(s), expect[s]
            assert msg.seq == r and msg.meta == Meta(r, r % slots, i, j, 0, (i, j, r)), (msg.meta, s, r)
            want = message_for(i, j, r, max_bytes, seed)
            assert len(msg.tensors) == len(want)
            for got, w in zip(msg.tensors, want):
                assert got.dtype == w.dtype and got.shape == w.shape, (s, j, r)
                assert torch.equal(as_bytes(got), as_bytes(w)), (s, j, r)  # bitwise (NaN != NaN)
            expect[s] = r + 1
            held[s].append(msg)
            while len(held[s]) > keep:  # release in random order
                held[s].pop(rng.randrange(len(held[s]))).release()
            for msg in [x for x in held[s] if x.seq <= expect[s] - slots]:  # would block the next one
                held[s].remove(msg)
                msg.release()
        for lst in held.values():
            for msg in lst:
                msg.release()
        assert all(v == rounds for v in expect.values())

    failed = threading.Event()

    def guard(fn, *a):
        try:
            fn(*a)
        except BaseException as e:
            errors.append(e)
            failed.set()

    threads = [threading.Thread(target=guard, args=(sender, i), daemon=True) for i in range(m)]
    threads += [threading.Thread(target=guard, args=(receiver, j), daemon=True) for j in range(n)]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout
    while any(t.is_alive() for t in threads) and not failed.is_set() and time.monotonic() < end:
        threads[0].join(0.05) if threads[0].is_alive() else next(t for t in threads if t.is_alive()).join(0.05)
    hung = not failed.is_set() and any(t.is_alive() for t in threads)
    with lock:
        for c in comms:
            c.close()  # a failure elsewhere: unblock whoever still waits (they then fail with PeerError)
    for t in threads:
        t.join(max(0.1, 5 - (time.monotonic() - end + timeout) if failed.is_set() else 10))
    assert not hung, f"exchange hung ({transport} {m}x{n})"
    real = [e for e in errors if not isinstance(e, PeerError)] or errors
    if real:
        raise real[0]


_counter = iter(range(10**9))


def _scenario():
    return st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 40), st.integers(1, 4),
                     st.integers(0, 3), st.sampled_from([0, 64, 3000, 40000, 300000]), st.booleans(),
                     st.integers(0, 10**6))


def _check(transport: str, sc) -> None:
    m, n, rounds, slots, hold, max_bytes, use_any, seed = sc
    run_exchange(transport, m, n, rounds, slots, hold, max_bytes, use_any, seed,
                 group=f"prop-{transport}-{next(_counter)}")


SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@SETTINGS
@given(_scenario())
def test_every_byte_arrives_in_order_shm(sc):
    _check("shm", sc)


@SETTINGS
@given(_scenario())
def test_every_byte_arrives_in_order_tcp(sc):
    _check("tcp", sc)


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_scenario())
def test_every_byte_arrives_in_order_torch(sc):
    _check("torch", sc)


BIDIR = CommConfig(transport="tcp", slot_bytes=4 << 20, num_slots=3, deadline_s=20)
SOCKET_BUFFER = 64 << 10  # far below a message: the kernel cannot hold what the transport does not read


def _small_socket_buffers(comm: Communicator, peer: str) -> None:
    """Shrinks the pair's kernel socket buffers, so that no host's TCP buffer sizes can swallow the
    messages and hide a transport that stops reading while it writes."""
    comm._links.send[peer].sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    comm._links.recv[peer].sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def push_both_ways(cfg: CommConfig, group: str) -> None:
    """Peers a and b each send ``num_slots`` slot-sized messages to the other before receiving any:
    neither send can complete unless the transport keeps draining what arrives while it waits to
    write. Raises the first error of either side; nothing is tolerated, since nothing can
    legitimately fail here: a deadlock ends in PeerTimeoutError at the deadline and must fail the
    test. AssertionError if a side is still blocked after every deadline it had."""
    store = dist.HashStore()
    errors: list[BaseException] = []
    both_received = threading.Barrier(2, timeout=cfg.deadline_s)
    n = cfg.slot_bytes // 4  # float32 elements that fill a slot

    def side(me: str, other: str) -> None:
        c = None
        try:
            c = Communicator(me, store, cfg, group=group).connect(send_to=[other], recv_from=[other])
            _small_socket_buffers(c, other)
            x = torch.full((n,), 1.5 if me == "a" else 2.5)
            for _ in range(cfg.num_slots):
                c.send(other, x)
            for _ in range(cfg.num_slots):
                with c.recv(other) as msg:
                    assert torch.equal(msg.tensors[0], torch.full((n,), 2.5 if me == "a" else 1.5))
            # close only once both sides have everything: a close() with credits still unread resets
            # the connection, and the other side would lose data it has not read yet
            both_received.wait()
        except BaseException as e:
            errors.append(e)
            both_received.abort()  # the other side stops waiting (its BrokenBarrierError comes after)
        finally:
            if c is not None:
                c.close()

    ts = [threading.Thread(target=side, args=("a", "b"), daemon=True),
          threading.Thread(target=side, args=("b", "a"), daemon=True)]
    for t in ts:
        t.start()
    # every wait of a side is bounded: connect, then 2 * num_slots sends and receives and the
    # barrier, each within a deadline; one more deadline of slack for a loaded machine
    end = time.monotonic() + cfg.connect_timeout_s + (2 * cfg.num_slots + 2) * cfg.deadline_s
    for t in ts:
        t.join(max(0.0, end - time.monotonic()))
    assert not any(t.is_alive() for t in ts), "a side is still blocked after all of its deadlines"
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])


def test_big_messages_both_ways_do_not_deadlock_tcp():
    """Two peers push 4 MiB messages at each other before receiving: TCP must keep draining."""
    push_both_ways(BIDIR, group="bidir")


def test_a_deadlock_fails_the_both_ways_check(monkeypatch):
    """The check above on a planted deadlock: TCP receive channels that ignore what arrives while
    their Communicator waits to write (the bug the test is for). Both sides then block in send until
    the deadline; push_both_ways must report that PeerTimeoutError, not swallow it."""
    monkeypatch.setattr(TcpRecvChannel, "on_event", lambda self, events: None)
    cfg = replace(BIDIR, deadline_s=2.0)  # the deadlock is certain: no need to wait 20 s for it
    t0 = time.monotonic()
    with pytest.raises(PeerTimeoutError, match="receiver did not take the data before the deadline"):
        push_both_ways(cfg, group="bidir-stalled")
    assert time.monotonic() - t0 >= cfg.deadline_s  # a send gave up at its deadline, not before
