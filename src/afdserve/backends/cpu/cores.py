"""Cores lent between the worker processes of one machine (``lend_idle_cores``): the cpu backend's
``afdserve.backends.host`` hooks.

A deployment whose workers share a machine's cores (the local cluster) splits them: each worker
runs ``num_threads`` threads. An attention worker that has nothing to do but wait for expert
replies leaves its cores idle, most of all during a prefill, whose MoE layers are most of its work.
So the front end creates a board in shared memory (an anonymous memfd that each local worker
inherits: nothing is left behind whatever happens to the processes); while a worker waits, it lends
its threads on its slot, and reclaims them when it wakes. The big kernels run in chunks of about
2^21 multiply-adds; between chunks they claim the lent threads no other worker holds and run helper
threads on them (``kernels/csrc/lend.h``): at most a chunk later, a worker that woke has its cores
back. A worker about to send to a lender first takes the lending back on its behalf
(``Lender.wake``): the message wakes it, and its cores must be free to run on, not claimed again
before it could reclaim them. It goes both ways: an expert worker's fused MoE borrows the cores of
attention workers waiting for its replies (a prefill's MoE layers are most of its work), and an
attention worker's LM head borrows those of expert workers waiting for the next layer (at a step
boundary, when every lane is at its LM head). A waiting worker wakes on the other's message, which
comes after the kernel, so the two rarely overlap at all.

Board layout: int32 [2, SLOTS]; row 0: threads the slot's owner lends now (0 while it computes),
row 1: the pid of the worker that holds them (0: nobody). Attention worker i owns slot i, expert
worker j slot SLOTS / 2 + j (``slot``).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from afdserve.backends.cpu import ops
from afdserve.config import cpu_cores

SLOTS = 1024
_BYTES = 2 * SLOTS * 4


def slot(role: str, index: int) -> int:
    """The board slot of a worker ("attention" or "expert", its index); -1 past its role's half."""
    half = SLOTS // 2
    return (index if role == "attention" else half + index) if 0 <= index < half else -1


class CoreBoard:
    def __init__(self, mm: mmap.mmap, fd: int | None):
        self.mm, self.fd = mm, fd  # fd: the creator's, passed to the workers it starts
        self._ints = memoryview(mm).cast("i")  # plain stores: a Python call per wait, not a tensor op
        self.tensor = torch.frombuffer(mm, dtype=torch.int32, count=2 * SLOTS).view(2, SLOTS)

    @classmethod
    def create(cls) -> "CoreBoard | None":
        """A new board (the front end's; its ``fd`` stays open until ``close`` so that replacements
        inherit it too); None where the system has no memfd."""
        if not hasattr(os, "memfd_create"):
            return None
        fd = os.memfd_create("afdserve-core-board")  # close-on-exec: only workers given it inherit it
        os.ftruncate(fd, _BYTES)
        return cls(mmap.mmap(fd, _BYTES), fd)

    @classmethod
    def attach(cls, fd: int) -> "CoreBoard":
        """The board a worker inherited as ``fd`` (mapped, then the descriptor is closed)."""
        try:
            return cls(mmap.mmap(fd, _BYTES), None)
        finally:
            os.close(fd)

    def lender(self, slot: int, threads: int) -> "Lender | None":
        """The owner's handle of ``slot`` (None past the board's slots: that worker lends nothing)."""
        return Lender(self._ints, slot, threads, self) if 0 <= slot < SLOTS and threads > 0 else None

    def borrow(self, most: int) -> bool:
        """This process's big kernels (fused MoE, the LM head's linear) borrow, chunk by chunk, up to
        ``most`` lent threads (False: no kernels here)."""
        if most <= 0 or not ops.available():
            return False
        ops.ops().lend_board(self.tensor, most)
        return True

    def read(self) -> list[tuple[int, int]]:
        """(threads lent, holder pid) of every slot (tests and diagnostics)."""
        return [(self._ints[i], self._ints[SLOTS + i]) for i in range(SLOTS)]

    def close(self) -> None:
        """Closes the creator's descriptor (workers keep their mappings until they exit)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Lender:
    """A worker's slot: ``lend`` before it waits, ``reclaim`` when it wakes."""

    def __init__(self, ints: memoryview, slot: int, threads: int, board: CoreBoard | None = None):
        self._ints, self.slot, self.threads = ints, slot, threads
        self.board = board  # the board it is on (kept mapped as long as its lender lives)
        self.reclaim()  # a replacement starts from a clean slot

    def lend(self) -> None:
        self._ints[self.slot] = self.threads

    def reclaim(self) -> None:
        self._ints[self.slot] = 0
        self._ints[SLOTS + self.slot] = 0  # a claim made before the wake lapses at its chunk's end

    def borrowed(self) -> bool:
        """Another worker runs threads on the cores this one lends now (its waits should not spin)."""
        return self._ints[SLOTS + self.slot] != 0

    def wake(self, peer: int) -> None:
        """Before this worker sends to the owner of slot ``peer``: that owner stops lending now, so
        threads borrowed on its cores leave at their next chunk and nothing claims them again
        before it has woken and run (it reclaims, and lends again, itself)."""
        self._ints[peer] = 0


@contextmanager
def lent(lender: "Lender | None") -> Iterator[None]:
    """The enclosed wait with ``lender``'s threads lent (nothing without a lender)."""
    if lender is None:
        yield
        return
    lender.lend()
    try:
        yield
    finally:
        lender.reclaim()


class CoreHooks:
    """``afdserve.backends.host.WorkerHooks`` over a worker's slot: its cores lent while it waits,
    a peer's lending taken back before a message to it, no spinning on cores a borrower holds."""

    def __init__(self, lender: Lender | None):
        self.lender = lender

    def waiting(self):
        return lent(self.lender)

    def sending(self, role: str, index: int) -> None:
        if self.lender is not None:
            self.lender.wake(slot(role, index))

    def spin_yield(self) -> bool:
        return self.lender is not None and self.lender.borrowed()


def join(fd: int, role: str, index: int, threads: int) -> CoreHooks:
    """A worker's place on the board it inherited as ``fd``: its big kernels borrow the threads
    others lend, and it lends its own ``threads`` on its slot while it waits (the board stays mapped
    as long as the hooks live)."""
    board = CoreBoard.attach(fd)
    board.borrow(borrowable_threads(threads))
    return CoreHooks(board.lender(slot(role, index), threads))


def borrowable_threads(own: int) -> int:
    """Threads a worker may borrow: the cores it may run on beyond its own threads."""
    return max(0, cpu_cores() - own)


def stop_borrowing() -> None:
    """This process's kernels borrow nothing from now on (no board)."""
    if ops.available():
        ops.ops().lend_board(torch.empty(0, dtype=torch.int32), 0)


def lent_threads_now() -> int:
    """The threads a big kernel of this process would borrow now (0 without a board)."""
    return int(ops.ops().lent_threads_now()) if ops.available() else 0


def lent_chunks() -> int:
    """Chunks of work this process's borrowed threads have run so far (diagnostics and tests)."""
    return int(ops.ops().lent_chunks()) if ops.available() else 0
