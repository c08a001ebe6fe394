"""torch.distributed point-to-point transport (gloo on CPU, NCCL on GPU): across nodes, and the fallback.

Each directed pair gets its own two-rank process group (sender = rank 0), created once per
membership epoch at connect time in a global order of pairs (so no two processes wait for each
other in different groups), never per call. A message's fixed-size header travels on the pair's
socket (host bytes: the receiver learns the payload's size without reading device memory, so a
message costs no host sync on a GPU); its payload is one point-to-point message, received into the
registered slot. The sender stages the payload in a local slot so that ``send`` can return before
the receiver has posted its receive (a synchronous send would deadlock the ping-pong pattern where
both sides send before they receive). A wait that times out leaves the group in an unknown state:
the pair is then unusable (later calls raise the same error).
"""

from __future__ import annotations

import datetime
import select
import socket
import time
from functools import partial
from typing import Sequence

import torch
import torch.distributed as dist

from afdserve.comm.channel import RecvChannel, SendChannel
from afdserve.comm.errors import PeerDeadError, PeerTimeoutError
from afdserve.comm.header import HEADER_BYTES, decode, encode_into, plan
from afdserve.comm.message import Message, Meta
from afdserve.comm.progress import Progress
from afdserve.comm.slots import SlotBuffer, slot_stride

_now = time.perf_counter
TAG = 0


def make_group(store: dist.Store, rank: int, backend: str, device: torch.device,
               timeout_s: float) -> dist.ProcessGroup:
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    if backend == "nccl":
        if device.type != "cuda":
            raise ValueError("the nccl backend needs CommConfig.device='cuda[:N]'")
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    raise ValueError(f"unknown torch.distributed backend {backend!r}")


class _TorchEnd:
    peer: str

    def _wait(self, work, deadline: float, what: str) -> None:
        rem = deadline - _now()
        try:
            if rem <= 0 and not work.is_completed():
                raise RuntimeError("Timed out (deadline already passed)")
            work.wait(datetime.timedelta(seconds=max(rem, 1e-3)))
        except RuntimeError as e:
            msg = str(e)
            if "imed out" in msg or "imeout" in msg:
                self._poison(PeerTimeoutError, f"{what} did not complete before the deadline")
            else:
                self._poison(PeerDeadError, f"{what} failed: {msg.splitlines()[0][:200]}")
            self.check()  # type: ignore[attr-defined]

    def _poison(self, error: type[Exception], reason: str) -> None:
        self.mark_gone(error, reason)  # type: ignore[attr-defined]


class TorchSendChannel(SendChannel, _TorchEnd):
    """Sends are asynchronous: the payload is staged in one of ``num_slots`` local slots and posted,
    its header written to the socket; a send waits only for the send posted ``num_slots`` messages
    earlier (like a credit)."""

    transport = "torch"

    def __init__(self, peer: str, sock: socket.socket, num_slots: int, slot_bytes: int, pg: dist.ProcessGroup,
                 device: torch.device) -> None:
        super().__init__(peer, sock, num_slots, slot_bytes)
        self.pg = pg
        self.device = device
        mem = torch.zeros(num_slots * slot_stride(slot_bytes), dtype=torch.uint8, device=device)
        self.buf = SlotBuffer(num_slots, slot_bytes, tensor=mem)
        self._hdr = bytearray(HEADER_BYTES)
        self._pending: list[list] = [[] for _ in range(num_slots)]

    def send(self, tensors: Sequence[torch.Tensor], meta: Meta, deadline: float, progress: Progress) -> None:
        descs, total = plan(tensors, self.slot_bytes, self.peer)
        self.check()
        k = self.next_seq
        s = k % self.num_slots
        for w in self._pending[s]:
            self._wait(w, deadline, f"sending message #{k - self.num_slots}")
        self._pending[s] = []
        encode_into(self._hdr, 0, k, meta, descs, total)
        self.buf.write(s, tensors, descs)
        if total:
            p = self.buf.payload_offset(s)
            self._pending[s] = [self.pg.send([self.buf.u8[p: p + total]], 1, TAG)]
        self._write_header(deadline, k)
        self.next_seq = k + 1

    def _write_header(self, deadline: float, k: int) -> None:
        """The header, whole, on the socket (it has room: at most ``num_slots`` headers are unread)."""
        view, sent = memoryview(self._hdr), 0
        while sent < HEADER_BYTES:
            try:
                sent += self.sock.send(view[sent:])  # type: ignore[union-attr]
                continue
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                self._poison(PeerDeadError, f"connection failed ({e.strerror or e})")
                self.check()
            rem = deadline - _now()
            if rem <= 0:
                self._poison(PeerTimeoutError, f"the header of message #{k} could not be written before the deadline")
                self.check()
            select.select([], [self.sock], [], rem)

    def close(self) -> None:
        self.close_socket()
        self.buf.release()


class TorchRecvChannel(RecvChannel, _TorchEnd):
    transport = "torch"

    def __init__(self, peer: str, sock: socket.socket, num_slots: int, slot_bytes: int, pg: dist.ProcessGroup,
                 device: torch.device) -> None:
        super().__init__(peer, sock, num_slots, slot_bytes)
        self.pg = pg
        self.device = device
        mem = torch.zeros(num_slots * slot_stride(slot_bytes), dtype=torch.uint8, device=device)
        self.buf = SlotBuffer(num_slots, slot_bytes, tensor=mem)
        self._inbox = bytearray()  # header bytes read from the socket, not taken yet

    def drain_socket(self) -> None:
        """Read the headers the sender wrote; notice EOF."""
        sock = self.sock
        if sock is None or self.gone is not None:
            return
        while True:
            try:
                data = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.mark_gone(PeerDeadError, f"connection failed ({e.strerror or e})")
                return
            if not data:
                self.mark_gone(PeerDeadError, "process died or closed (connection closed)")
                return
            self._inbox += data

    def ready(self) -> bool:
        if len(self._inbox) < HEADER_BYTES:
            self.drain_socket()
        return len(self._inbox) >= HEADER_BYTES

    def take(self, deadline: float) -> Message:
        k = self.next_seq
        s = k % self.num_slots
        try:
            h = decode(self._inbox)
        except ValueError as e:
            self._poison(PeerDeadError, f"protocol error: {e}")
            self.check()
        del self._inbox[:HEADER_BYTES]
        if h.seq != k:
            self._poison(PeerDeadError, f"protocol error: got message #{h.seq}, expected #{k}")
            self.check()
        if h.payload_bytes:
            if h.payload_bytes > self.slot_bytes:
                self._poison(PeerDeadError, f"protocol error: message #{k} larger than a slot")
                self.check()
            p = self.buf.payload_offset(s)
            work = self.pg.recv([self.buf.u8[p: p + h.payload_bytes]], 0, TAG)
            self._wait(work, deadline, f"receiving the payload of message #{k}")
        self.held[s] = True
        self.next_seq = k + 1
        return Message(self.peer, k, h.meta, self.buf.tensors(s, h.tensors), h.payload_bytes,
                       partial(self._release, k))

    def _release(self, k: int) -> None:
        self.held[k % self.num_slots] = False

    def close(self) -> None:
        self.close_socket()
        self.buf.release()
