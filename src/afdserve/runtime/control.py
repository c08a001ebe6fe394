"""A worker's control channel to the front end: typed messages (``afdserve.runtime.messages``) in
their one encoding over a ``multiprocessing`` connection (a local pipe, or TCP for Ray actors)."""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection

from afdserve.runtime.messages import FromWorker, ToWorker, decode, encode


class ControlChannel:
    def __init__(self, conn: Connection):
        self.conn = conn
        self._lock = threading.Lock()  # a worker's heartbeat thread sends too

    def send(self, msg: ToWorker | FromWorker) -> None:
        data = encode(msg)
        with self._lock:
            self.conn.send_bytes(data)

    def recv(self) -> ToWorker | FromWorker:
        return decode(self.conn.recv_bytes())

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()
