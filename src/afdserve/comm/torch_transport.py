"""torch.distributed point-to-point transport (gloo on CPU, NCCL on GPU): the baseline and fallback.

Each directed pair gets its own two-rank process group (sender = rank 0), created once at connect
time in a global order of pairs (so no two processes wait for each other in different groups).
A message is the fixed-size header followed by the payload (one point-to-point message each),
received into the registered slot; the sender stages it in a local slot so that ``send`` can
return before the receiver has posted its receive (a synchronous send would deadlock the ping-pong
pattern where both sides send before they receive). torch.distributed needs the exact size of every receive, hence
the separate header. A wait that times out leaves the group in an unknown state: the pair is then
unusable (later calls raise the same error).
"""

from __future__ import annotations

import datetime
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
    """Sends are asynchronous: the message is staged in one of ``num_slots`` local slots and posted;
    a send waits only for the sends posted ``num_slots`` messages earlier (like a credit)."""

    transport = "torch"

    def __init__(self, peer: str, sock: socket.socket, num_slots: int, slot_bytes: int, pg: dist.ProcessGroup,
                 device: torch.device) -> None:
        super().__init__(peer, sock, num_slots, slot_bytes)
        self.pg = pg
        self.device = device
        mem = torch.zeros(num_slots * slot_stride(slot_bytes), dtype=torch.uint8, device=device)
        self.buf = SlotBuffer(num_slots, slot_bytes, tensor=mem)
        self._hdr_cpu = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        self._hdr_np = self._hdr_cpu.numpy()
        self._pending: list[list] = [[] for _ in range(num_slots)]
        self._unsent = 0

    def send(self, tensors: Sequence[torch.Tensor], meta: Meta, deadline: float, progress: Progress) -> None:
        descs, total = plan(tensors, self.slot_bytes, self.peer)
        self.check()
        k = self.next_seq
        s = k % self.num_slots
        for w in self._pending[s]:
            self._wait(w, deadline, f"sending message #{k - self.num_slots}")
        self._pending[s] = []
        h = self.buf.header_offset(s)
        hdr = self.buf.u8[h: h + HEADER_BYTES]
        if self.buf.is_host:
            encode_into(hdr.numpy(), 0, k, meta, descs, total)
        else:
            encode_into(self._hdr_np, 0, k, meta, descs, total)
            hdr.copy_(self._hdr_cpu)
        self.buf.write(s, tensors, descs)
        works = [self.pg.send([hdr], 1, TAG)]
        if total:
            p = self.buf.payload_offset(s)
            works.append(self.pg.send([self.buf.u8[p: p + total]], 1, TAG))
        self._pending[s] = works
        self.next_seq = k + 1
        self._unsent += 1
        self._notify()

    def _notify(self) -> None:
        """One byte per message on the pair's socket: lets the receiver's recv_any poll this pair."""
        try:
            n = self.sock.send(b"\x01" * self._unsent)  # type: ignore[union-attr]
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = self._unsent
        self._unsent -= n

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
        self._notified = 0  # notification bytes seen = messages the sender has posted
        self._hwork = None
        self._post_header()

    def _post_header(self) -> None:
        """Post the receive of the next header ahead of time (gloo is fastest when the receive is
        already posted when data arrives). Only the header area of the slot is written, never the
        payload a held Message may still view."""
        off = self.buf.header_offset(self.next_seq % self.num_slots)
        self._hwork = self.pg.recv([self.buf.u8[off: off + HEADER_BYTES]], 0, TAG)

    def drain_socket(self) -> None:
        """Count the sender's one-byte notifications (gloo cannot be polled: is_completed() only
        turns true inside wait()); notice EOF."""
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
            self._notified += len(data)

    def ready(self) -> bool:
        if self._notified <= self.next_seq:
            self.drain_socket()
        return self._notified > self.next_seq

    def recv(self, deadline: float, progress: Progress) -> Message:
        self.check()
        self.check_slot()
        return self.take(deadline)

    def take(self, deadline: float) -> Message:
        k = self.next_seq
        s = k % self.num_slots
        off = self.buf.header_offset(s)
        self._wait(self._hwork, deadline, f"receiving message #{k}")
        off = self.buf.header_offset(s)
        raw = self.buf.u8[off: off + HEADER_BYTES]
        h = decode(raw.numpy() if raw.device.type == "cpu" else raw.cpu().numpy())
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
        self._post_header()
        if self._notified < self.next_seq:
            self.drain_socket()  # keep the notification stream drained
        return Message(self.peer, k, h.meta, self.buf.tensors(s, h.tensors), h.payload_bytes,
                       partial(self._release, k))

    def _release(self, k: int) -> None:
        self.held[k % self.num_slots] = False

    def close(self) -> None:
        self.close_socket()
        self.buf.release()

