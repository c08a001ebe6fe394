"""The random M2N exchange across real processes (multiprocessing 'spawn'), on every transport,
in both directions at once (every worker sends to and receives from its peers, like attention
and expert workers doing dispatch and combine)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import random
import traceback

import torch

from afdserve.comm import CommConfig, Communicator, Meta, list_segments

M, N, ROUNDS, SLOTS = 3, 2, 15, 3
TRANSPORTS = ["shm", "tcp", "torch"]


def _payload(src: str, dst: str, r: int) -> torch.Tensor:
    rng = random.Random(f"{src}>{dst}#{r}")
    n = rng.choice([0, 0, 1, 17, 4096, 70000, 260000])
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _worker(me: str, peers: list[str], host: str, port: int, out) -> None:
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist

        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))
        for transport in TRANSPORTS:
            cfg = CommConfig(transport=transport, slot_bytes=300000, num_slots=SLOTS, deadline_s=30,
                             connect_timeout_s=60)
            comm = Communicator(me, store, cfg, group=f"mp-{transport}").connect(send_to=peers, recv_from=peers)
            expect = {p: 0 for p in peers}
            got = 0
            for r in range(ROUNDS):
                for p in peers:  # dispatch/combine both ways: send a round, then take what has arrived
                    comm.send(p, _payload(me, p, r), Meta(step=r, ints=(r,)))
                while any(v <= r for v in expect.values()):
                    with comm.recv_any([p for p in peers if expect[p] <= r]) as msg:
                        k = expect[msg.peer]
                        assert msg.meta.step == k and msg.seq == k, (transport, me, msg.peer, k, msg.meta)
                        assert torch.equal(msg.tensors[0], _payload(msg.peer, me, k)), (transport, me, msg.peer, k)
                        expect[msg.peer] = k + 1
                        got += msg.tensors[0].numel()
            store.add(f"done-{transport}", 1)  # nobody closes while a peer may still wait on it
            out.put((me, transport, got, sorted({comm.transport(p) for p in peers})))
            store.wait([f"all-{transport}"], datetime.timedelta(seconds=60))
            comm.close()
    except BaseException:
        out.put((me, "error", traceback.format_exc(), []))


def test_random_exchange_across_processes():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    attn = [f"attn{i}" for i in range(M)]
    experts = [f"exp{j}" for j in range(N)]
    procs = [ctx.Process(target=_worker, args=(a, experts, store.host, store.port, out), daemon=True) for a in attn]
    procs += [ctx.Process(target=_worker, args=(e, attn, store.host, store.port, out), daemon=True) for e in experts]
    for p in procs:
        p.start()
    pids = [p.pid for p in procs]
    results = []
    try:
        for transport in TRANSPORTS:
            for _ in range(M + N):
                me, t, got, used = out.get(timeout=90)
                assert t != "error", f"{me} failed:\n{got}"
                results.append((me, t, got, used))
            assert store.add(f"done-{transport}", 0) == M + N
            store.set(f"all-{transport}", "1")
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    for me, t, got, used in results:
        assert used == [t]
        peers = experts if me in attn else attn
        assert got == sum(_payload(p, me, r).numel() for p in peers for r in range(ROUNDS))
    assert not [s for s in list_segments() if any(s.startswith(f"afd_{pid}_") for pid in pids + [os.getpid()])]
