"""A worker's control channel to the front end: typed messages (``afdserve.runtime.messages``) in
their one encoding over a ``multiprocessing`` connection (a local pipe, or TCP for Ray actors)."""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import Connection

from afdserve.runtime.messages import FromWorker, ToWorker, decode, encode


# a busy worker looks at its control channel at most this often (each look is a system call; a
# request or a membership change waits at most this long more)
POLL_INTERVAL_S = 0.001


class ControlChannel:
    def __init__(self, conn: Connection):
        self.conn = conn
        self._lock = threading.Lock()  # a worker's heartbeat thread sends too
        self._next_look = 0.0

    def send(self, msg: ToWorker | FromWorker) -> None:
        data = encode(msg)
        with self._lock:
            self.conn.send_bytes(data)

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
