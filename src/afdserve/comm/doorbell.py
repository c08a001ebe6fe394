"""A Communicator's doorbell: one small shared-memory segment its shared-memory peers map.

The owner announces in ``WAITING`` that it is about to sleep and how: on the futex word ``BELL``
(all its waits involve shared-memory pairs only) or in ``poll`` on its sockets (a TCP or torch
pair is involved too). A peer that has just completed something the owner may wait for (a
message, a released slot) reads ``WAITING`` and bumps+wakes the futex or writes a byte on the
pair's socket; when nobody waits it costs one load. A waiter sleeps at most ``BLOCK_CHUNK_S``
at a time, which bounds the cost of the (rare, store-buffer) race between the owner's
"WAITING = 1, check" and the peer's "complete, read WAITING".
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from afdserve.comm import futex
from afdserve.comm.shm import Segment

SIZE = 4096
_MAGIC = 0xAFDB_E11
_W_MAGIC, _W_BELL, _W_WAITING = 0, 16, 32  # u32 word indices (bell and waiting on their own lines)
NOT_WAITING, FUTEX, SOCKET = 0, 1, 2


class Doorbell:
    def __init__(self, seg: Segment) -> None:
        self.seg = seg
        self.name = seg.name
        self._w = np.frombuffer(seg.mm, dtype=np.uint32, count=SIZE // 4)
        self._bell_addr = self._w.ctypes.data + 4 * _W_BELL

    @classmethod
    def create(cls) -> "Doorbell":
        d = cls(Segment.create(SIZE))
        d._w[_W_MAGIC] = _MAGIC
        return d

    @classmethod
    def attach(cls, name: str) -> "Doorbell":
        d = cls(Segment.attach(name, SIZE))
        if int(d._w[_W_MAGIC]) != _MAGIC:
            d.close()
            raise ValueError(f"segment {name} is not a doorbell")
        return d

    # -- owner ---------------------------------------------------------------------------------------
    def set_waiting(self, mode: int) -> None:
        self._w[_W_WAITING] = mode

    def value(self) -> int:
        return int(self._w[_W_BELL])

    def sleep(self, expected: int, timeout_s: float) -> None:
        futex.wait(self._bell_addr, expected, timeout_s)

    # -- peers ---------------------------------------------------------------------------------------
    def notify(self, ring_socket: Callable[[], None]) -> None:
        """Wake the owner if it announced that it sleeps (futex, or socket via ``ring_socket``)."""
        mode = self._w[_W_WAITING]
        if mode == FUTEX:
            self._w[_W_BELL] += 1
            futex.wake(self._bell_addr)
        elif mode == SOCKET:
            ring_socket()

    def close(self) -> None:
        self._w = np.zeros(SIZE // 4, dtype=np.uint32)
        self.seg.close()


def _no_socket() -> None:
    return None


NO_SOCKET = _no_socket
