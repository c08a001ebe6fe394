"""A worker's control channel to the front end: typed messages (``afdserve.runtime.messages``) in
their one encoding over a ``multiprocessing`` connection (a local socket, or TCP for Ray actors).

A local worker's messages to the front end also ring a *bell*, an eventfd the front end sleeps on
(``wait_any``) instead of the socket. Data written to a socket (or pipe) wakes its reader
synchronously: the scheduler pulls the reader onto the writer's core and lets it preempt the writer
there. The front end, woken so by an attention worker's step outputs, would take that worker's core
for as long as it handles them (milliseconds for a few hundred sequences), while the other core
may sit idle. An eventfd's wake-up is not synchronous: the front end runs on an idle core if there
is one. It still wakes on a hang-up of the socket (a dead worker)."""

from __future__ import annotations

import os
import select
import threading
import time
from multiprocessing.connection import Connection

from afdserve.runtime.messages import FromWorker, ToWorker, decode, encode


# a busy worker looks at its control channel at most this often (each look is a system call; a
# request or a membership change waits at most this long more)
POLL_INTERVAL_S = 0.001


class ControlChannel:
    def __init__(self, conn: Connection, ring: int | None = None, bell: int | None = None):
        """``ring``: the eventfd this side writes after each message (a local worker); ``bell``: the
        one the other side rings (the front end's end of a local worker's channel; closed with it)."""
        self.conn = conn
        self.ring, self.bell = ring, bell
        self._lock = threading.Lock()  # a worker's heartbeat thread sends too
        self._next_look = 0.0

    def send(self, msg: ToWorker | FromWorker) -> None:
        data = encode(msg)
        with self._lock:
            self.conn.send_bytes(data)
            if self.ring is not None:
                os.eventfd_write(self.ring, 1)

    def recv(self) -> ToWorker | FromWorker:
        return decode(self.conn.recv_bytes())

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def due(self) -> bool:
        """Whether a busy worker looks at the channel now: at most every ``POLL_INTERVAL_S``."""
        now = time.monotonic()
        if now < self._next_look:
            return False
        self._next_look = now + POLL_INTERVAL_S
        return True

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()
        if self.bell is not None:
            os.close(self.bell)
            self.bell = None


def new_bell() -> int | None:
    """A bell for a local worker's channel (None where the platform has no eventfd)."""
    eventfd = getattr(os, "eventfd", None)
    return eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) if eventfd is not None else None


def close_bell(bell: int | None) -> None:
    if bell is not None:
        os.close(bell)


def wait_any(channels: list[ControlChannel], timeout: float) -> list[ControlChannel]:
    """The channels with a message to read, or closed by the other side, waiting up to ``timeout``
    seconds for one. A channel with a bell wakes this wait by its bell (or a hang-up), not by data."""
    # messages not read yet (whose rings an earlier call may have taken) are found without waiting
    ready = [c for c in channels if c.bell is not None and c.conn.poll(0)]
    for c in ready:
        _take_ring(c.bell)  # (a message is read after its ring is taken: none is missed)
    if ready:
        return ready
    p, of = select.poll(), {}
    for c in channels:
        fd = c.conn.fileno()
        if c.bell is None:
            p.register(fd, select.POLLIN)
        else:  # data on the socket does not wake this poll, its hang-up does; the bell does
            p.register(fd, select.POLLRDHUP)
            p.register(c.bell, select.POLLIN)
            of[c.bell] = c
        of[fd] = c
    got: list[ControlChannel] = []
    for fd, _ in p.poll(max(0, int(timeout * 1000 + 0.999))):
        c = of[fd]
        if fd == c.bell:
            _take_ring(c.bell)
        if c not in got:
            got.append(c)
    return got


def _take_ring(bell: int) -> None:
    try:
        os.eventfd_read(bell)
    except BlockingIOError:  # not rung since it was last taken
        pass
