"""Property: random M x N groups (<= 4 x 4), random per-pair payloads (zero bytes included), many
rounds with several slots in flight and out-of-order releases: every byte arrives intact and in
order per pair, on every transport. Endpoints run as threads here; test_comm_multiproc.py runs
the same exchange across processes."""

from __future__ import annotations

import random
import threading
import time

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afdserve.comm import CommConfig, Communicator, Meta, PeerError

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


def test_big_messages_both_ways_do_not_deadlock_tcp():
    """Two peers push 4 MiB messages at each other before receiving: TCP must keep draining."""
    store = dist.HashStore()
    cfg = CommConfig(transport="tcp", slot_bytes=4 << 20, num_slots=3, deadline_s=20)
    errors: list[BaseException] = []

    def side(me: str, other: str) -> None:
        try:
            c = Communicator(me, store, cfg, group="bidir").connect(send_to=[other], recv_from=[other])
            x = torch.full((1 << 20,), 1.5 if me == "a" else 2.5)
            for _ in range(3):
                c.send(other, x)
            for _ in range(3):
                with c.recv(other) as msg:
                    assert torch.equal(msg.tensors[0], torch.full((1 << 20,), 2.5 if me == "a" else 1.5))
            c.close()
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=side, args=("a", "b"), daemon=True),
          threading.Thread(target=side, args=("b", "a"), daemon=True)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "deadlock"
    real = [e for e in errors if not isinstance(e, PeerError)]
    assert not real, real
