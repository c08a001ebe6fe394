"""The two ends of one directed pair (sender -> receiver), independent of the transport.

Message ``k`` of a pair always goes to slot ``k % num_slots``; the sender may write it once the
receiver has released message ``k - num_slots`` (a credit). The receiver delivers messages in order.
Every pair keeps one persistent socket to its peer: TCP moves data on it, the other transports use it
for wake-ups and to learn at once (EOF) that the peer's process is gone.
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from typing import Sequence

import torch

from afdserve.comm.errors import PeerClosedError, PeerDeadError, PeerTimeoutError, SlotBusyError
from afdserve.comm.message import Message, Meta
from afdserve.comm.progress import Progress


class Channel(ABC):
    transport: str = "?"
    futex_ok = False  # may a wait on this pair alone sleep on the doorbell futex? (shared memory)

    def __init__(self, peer: str, sock: socket.socket | None, num_slots: int, slot_bytes: int) -> None:
        self.peer = peer
        self.sock = sock
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.next_seq = 0
        self.gone: str | None = None  # why the peer is unusable
        self.gone_error: type[Exception] = PeerDeadError
        self._fd = sock.fileno() if sock is not None else -1

    def fileno(self) -> int:
        return self._fd

    def mark_gone(self, error: type[Exception], reason: str) -> None:
        if self.gone is None:
            self.gone, self.gone_error = reason, error

    def check(self) -> None:
        """Raise the peer's error if it is gone."""
        if self.gone is not None:
            raise self.gone_error(self.peer, self.gone)

    def _peer_closed_flag(self) -> bool:
        """Did the peer announce an orderly close before its socket ended? (transport-specific)"""
        return False

    def drain_socket(self) -> None:
        """Read and drop wake-up bytes; notice EOF."""
        sock = self.sock
        if sock is None or self.gone is not None:
            return
        while True:
            try:
                data = sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.mark_gone(PeerDeadError, f"connection failed ({e.strerror or e})")
                return
            if not data:
                if self._peer_closed_flag():
                    self.mark_gone(PeerClosedError, "closed its side of the channel")
                else:
                    self.mark_gone(PeerDeadError, "process died (connection closed without goodbye)")
                return

    def on_event(self, events: int) -> None:
        self.drain_socket()

    def ring(self) -> None:
        """Wake the peer if it sleeps in poll (one byte; a full socket buffer already wakes it)."""
        try:
            self.sock.send(b"\x01")  # type: ignore[union-attr]
        except (BlockingIOError, InterruptedError, OSError):
            pass

    def close_socket(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass

    @abstractmethod
    def close(self) -> None:
        """Orderly close: tell the peer, drop the registered memory."""


class SendChannel(Channel):
    @abstractmethod
    def send(self, tensors: Sequence[torch.Tensor], meta: Meta, deadline: float, progress: Progress) -> None:
        """Write the message into the receiver's next slot; wait (until ``deadline``) for a free one."""

    def _credit_timeout(self, seq: int) -> PeerTimeoutError:
        return PeerTimeoutError(self.peer, f"all {self.num_slots} slots still held by the receiver: message "
                                           f"#{seq} could not be sent before the deadline (peer stalled?)")


class RecvChannel(Channel):
    def __init__(self, peer: str, sock: socket.socket | None, num_slots: int, slot_bytes: int) -> None:
        super().__init__(peer, sock, num_slots, slot_bytes)
        self.held = [False] * num_slots

    def check_slot(self) -> None:
        s = self.next_seq % self.num_slots
        if self.held[s]:
            raise SlotBusyError(
                f"from {self.peer!r}: message #{self.next_seq} needs slot {s}, still held by message "
                f"#{self.next_seq - self.num_slots}; release() messages (or configure more slots)")

    @abstractmethod
    def ready(self) -> bool:
        """Has the next message fully arrived? (no blocking)"""

    @abstractmethod
    def take(self, deadline: float) -> Message:
        """Return the next message (``ready()`` was True, except for transports that block here)."""

    def timeout_error(self) -> PeerTimeoutError:
        return PeerTimeoutError(self.peer, f"message #{self.next_seq} did not arrive before the deadline")

    def busy(self) -> bool:
        """Is the peer writing the next message right now (worth spinning for)?"""
        return False

    def wait_ready(self, deadline: float, progress: Progress) -> None:
        progress.wait(self.ready, self.check, deadline, self.timeout_error, busy=self.busy,
                      futex_ok=self.futex_ok)

    def recv(self, deadline: float, progress: Progress) -> Message:
        self.check_slot()
        if not self.ready():
            self.wait_ready(deadline, progress)
        return self.take(deadline)
