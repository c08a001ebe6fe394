"""The progress engine of one Communicator: its sockets in one poll set, and the wait loop.

Every wait spins for up to ``spin_s`` (checking a condition that costs no system call for shared
memory; the budget adapts, see ``wait``) and then blocks, so that a blocked process burns no core:
on its doorbell futex when only shared-memory pairs are involved (peers wake it, see
``doorbell.py``; between sleeps it polls its sockets, so a dead peer is noticed within
``BLOCK_CHUNK_S``), otherwise in ``poll`` on all of its sockets (TCP data wakes it by arriving,
a shared-memory peer by writing a byte, a dead peer by closing its socket). While blocked, any
TCP data that arrives for *any* pair is read straight into its registered slot.
"""

from __future__ import annotations

import math
import select
import time
from typing import Callable, Protocol

from afdserve.comm.doorbell import FUTEX, NOT_WAITING, SOCKET, Doorbell

POLLIN = select.POLLIN | select.POLLPRI
POLLERR = select.POLLERR | select.POLLHUP | select.POLLNVAL
BLOCK_CHUNK_S = 0.002  # longest single sleep: bounds the cost of a (theoretical) missed wake-up
BUSY_SPIN_S = 0.002  # longest extra spin while the peer is visibly writing the awaited message
_now = time.perf_counter


class Handler(Protocol):
    def fileno(self) -> int: ...

    def on_event(self, events: int) -> None: ...


class Progress:
    def __init__(self, spin_s: float) -> None:
        self.spin_s = spin_s
        self.bell: Doorbell | None = None  # this Communicator's doorbell (if it has shm pairs)
        self._spin = spin_s  # adaptive budget, see wait()
        # True: stop spinning and sleep now (the user knows this core is wanted elsewhere); None:
        # spin as budgeted
        self.no_spin: Callable[[], bool] | None = None
        self._waits = 0
        self._poll = select.poll()
        self._handlers: dict[int, Handler] = {}

    def add(self, handler: Handler) -> None:
        fd = handler.fileno()
        self._handlers[fd] = handler
        self._poll.register(fd, POLLIN)

    def discard(self, handler: Handler) -> None:
        fd = handler.fileno()
        if self._handlers.get(fd) is handler:
            del self._handlers[fd]
            try:
                self._poll.unregister(fd)
            except (KeyError, ValueError):
                pass

    def pump(self, timeout_s: float, write_fd: int = -1) -> bool:
        """Wait up to ``timeout_s`` for socket events and handle them; True if ``write_fd`` is writable."""
        ms = 0 if timeout_s <= 0 else max(1, math.ceil(timeout_s * 1000))
        if write_fd >= 0:
            self._poll.modify(write_fd, POLLIN | select.POLLOUT)
        try:
            events = self._poll.poll(ms)
        except InterruptedError:  # pragma: no cover - PEP 475 retries, kept for safety
            events = []
        finally:
            if write_fd >= 0:
                self._poll.modify(write_fd, POLLIN)
        writable = False
        for fd, ev in events:
            if fd == write_fd and ev & (select.POLLOUT | POLLERR):
                writable = True
            h = self._handlers.get(fd)
            if h is not None and ev & (POLLIN | POLLERR):
                h.on_event(ev)
        return writable

    def wait(self, ready: Callable[[], bool], check: Callable[[], None], deadline: float,
             timeout_error: Callable[[], Exception], busy: Callable[[], bool] | None = None,
             futex_ok: bool = False) -> None:
        """Return once ``ready()``; raise what ``check()`` raises (dead peer) or ``timeout_error()``.

        ``busy()`` True means the peer is writing the awaited message right now: keep spinning
        (up to ``BUSY_SPIN_S`` more) rather than pay a wake-up at the end of its copy.
        ``futex_ok``: every pair involved is shared memory, so sleep on the doorbell futex.

        The spin budget adapts: spinning only pays when the peer runs on another core. When it
        shares ours, spinning just delays it, the spin fails, and the budget halves (down to
        blocking at once); a successful spin restores the full ``spin_s``, and every 16th wait
        probes the full ``spin_s``. While ``no_spin()`` holds, a wait does not spin at all.
        """
        if ready():
            return
        self._waits += 1
        budget = self.spin_s if not self._waits & 15 else self._spin
        no_spin = self.no_spin
        if budget > 0:
            now = _now()
            spin_end = min(now + budget, deadline)
            busy_end = min(spin_end + BUSY_SPIN_S, deadline) if busy is not None else spin_end
            while True:
                if ready():
                    self._spin = self.spin_s
                    return
                if no_spin is not None and no_spin():
                    break  # not a failed spin: the budget stays
                now = _now()
                if now >= spin_end and (now >= busy_end or not busy()):  # type: ignore[misc]
                    self._spin = self._spin / 2 if self._spin > 2e-6 else 0.0
                    break
        bell = self.bell
        use_futex = futex_ok and bell is not None
        mode = FUTEX if use_futex else SOCKET
        while True:
            if bell is not None:
                bell.set_waiting(mode)
            try:
                v = bell.value() if use_futex else 0  # type: ignore[union-attr]
                if ready():
                    return
                check()
                rem = deadline - _now()
                if rem <= 0:
                    raise timeout_error()
                if use_futex:
                    bell.sleep(v, min(rem, BLOCK_CHUNK_S))  # type: ignore[union-attr]
                    if ready():
                        return
                    self.pump(0)  # socket events: EOF of a dead peer, TCP data
                else:
                    self.pump(min(rem, BLOCK_CHUNK_S))
            finally:
                if bell is not None:
                    bell.set_waiting(NOT_WAITING)
            if ready():
                return
