"""A worker's control channel to the front end: typed messages (``afdserve.runtime.messages``) in
their one encoding over a ``multiprocessing`` connection (a local pipe, or TCP for Ray actors)."""

from __future__ import annotations

from multiprocessing.connection import Connection

from afdserve.runtime.messages import FromWorker, ToWorker, decode, encode


class ControlChannel:
    def __init__(self, conn: Connection):
        self.conn = conn

    def send(self, msg: ToWorker | FromWorker) -> None:
        self.conn.send_bytes(encode(msg))

    def recv(self) -> ToWorker | FromWorker:
        return decode(self.conn.recv_bytes())

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()
