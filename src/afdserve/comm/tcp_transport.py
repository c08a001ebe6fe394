"""TCP transport: one persistent connection per pair; payload received straight into the slot.

Sender -> receiver: frames of ``HEADER_BYTES`` header + payload, written with one scatter-gather
``sendmsg`` from the tensors' own memory (no staging copy, no pickling). The receiver reads the
header into the slot's header area, then ``recv_into`` the slot's payload area.
Receiver -> sender: 8-byte credits (``seq + 1`` of a released message; ``BYE`` on orderly close).

All sockets are non-blocking and progress whenever the owning Communicator waits on anything (see
``progress.py``), so two processes sending large messages to each other cannot deadlock.
"""

from __future__ import annotations

import mmap
import socket
import struct
import time
from functools import partial
from typing import Sequence

import torch

from afdserve.comm.channel import RecvChannel, SendChannel
from afdserve.comm.errors import PeerClosedError, PeerDeadError, PeerTimeoutError
from afdserve.comm.header import ALIGN, FLAG_BYE, HEADER_BYTES, Header, decode, encode_into, plan
from afdserve.comm.message import Message, Meta
from afdserve.comm.progress import Progress
from afdserve.comm.slots import SlotBuffer, slot_stride

_CREDIT = struct.Struct("<Q")
BYE_CREDIT = (1 << 64) - 1
_ZEROS = memoryview(bytes(ALIGN))
_now = time.perf_counter


def _byte_view(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class TcpSendChannel(SendChannel):
    transport = "tcp"

    def __init__(self, peer: str, sock: socket.socket, num_slots: int, slot_bytes: int) -> None:
        super().__init__(peer, sock, num_slots, slot_bytes)
        self.freed = [0] * num_slots  # per slot: seq + 1 of the last message released there
        self._credit_buf = bytearray()
        self._hdr = bytearray(HEADER_BYTES)
        self._bye_seen = False

    def _peer_closed_flag(self) -> bool:
        return self._bye_seen

    def drain_socket(self) -> None:
        if self.gone is not None:
            return
        while True:
            try:
                data = self.sock.recv(65536)  # type: ignore[union-attr]
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self.mark_gone(PeerDeadError, f"connection failed ({e.strerror or e})")
                break
            if not data:
                if self._bye_seen:
                    self.mark_gone(PeerClosedError, "closed its side of the channel")
                else:
                    self.mark_gone(PeerDeadError, "process died (connection closed without goodbye)")
                break
            self._credit_buf += data
        cb = self._credit_buf
        n = len(cb) // 8
        if n:
            for (v,) in _CREDIT.iter_unpack(bytes(cb[: n * 8])):
                if v == BYE_CREDIT:
                    self._bye_seen = True
                else:
                    s = (v - 1) % self.num_slots
                    if v > self.freed[s]:
                        self.freed[s] = v
            del cb[: n * 8]

    def _has_credit(self, s: int, need: int) -> bool:
        if self.freed[s] >= need:
            return True
        self.drain_socket()
        return self.freed[s] >= need

    def send(self, tensors: Sequence[torch.Tensor], meta: Meta, deadline: float, progress: Progress) -> None:
        descs, total = plan(tensors, self.slot_bytes, self.peer)
        self.check()
        k = self.next_seq
        s = k % self.num_slots
        need = k - self.num_slots + 1
        if need > 0 and not self._has_credit(s, need):
            progress.wait(lambda: self._has_credit(s, need), self.check, deadline,
                          lambda: self._credit_timeout(k))
        encode_into(self._hdr, 0, k, meta, descs, total)
        bufs: list[memoryview] = [memoryview(self._hdr)]
        pos = 0
        for t, d in zip(tensors, descs):
            if d.nbytes == 0:
                continue
            if d.offset > pos:
                bufs.append(_ZEROS[: d.offset - pos])
            bufs.append(_byte_view(t))
            pos = d.offset + d.nbytes
        if total > pos:
            bufs.append(_ZEROS[: total - pos])
        self._send_all(bufs, HEADER_BYTES + total, deadline, progress, k)
        self.next_seq = k + 1

    def _send_all(self, bufs: list[memoryview], nbytes: int, deadline: float, progress: Progress, k: int) -> None:
        sock = self.sock
        assert sock is not None
        sent_total = 0
        while True:
            try:
                n = sock.sendmsg(bufs)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self.mark_gone(PeerDeadError, f"connection failed while sending ({e.strerror or e})")
                self.check()
                raise
            sent_total += n
            if sent_total >= nbytes:
                return
            while n:  # drop what went out
                b = bufs[0]
                if n >= len(b):
                    n -= len(b)
                    bufs.pop(0)
                else:
                    bufs[0] = b[n:]
                    n = 0
            rem = deadline - _now()
            if rem <= 0:
                if sent_total:
                    self.mark_gone(PeerTimeoutError, "a send timed out half-way; the stream is unusable")
                raise PeerTimeoutError(self.peer, f"message #{k}: receiver did not take the data before "
                                                  f"the deadline ({sent_total}/{nbytes} bytes sent)")
            progress.pump(min(rem, 0.002), write_fd=self._fd)
            self.check()

    def close(self) -> None:
        if self.gone is None and self.sock is not None:
            try:
                encode_into(self._hdr, 0, self.next_seq, Meta(), (), 0, flags=FLAG_BYE)
                self.sock.send(self._hdr)
            except OSError:
                pass
        self.close_socket()


class TcpRecvChannel(RecvChannel):
    transport = "tcp"

    def __init__(self, peer: str, sock: socket.socket, num_slots: int, slot_bytes: int) -> None:
        super().__init__(peer, sock, num_slots, slot_bytes)
        size = num_slots * slot_stride(slot_bytes)
        self._mm = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        self.buf = SlotBuffer(num_slots, slot_bytes, mem=self._mm)
        self._headers: list[Header | None] = [None] * num_slots
        self._rx_seq = 0  # frame being read
        self._rx_off = 0  # bytes of it read so far
        self._rx_need = HEADER_BYTES  # bytes of it to read (header only until the header is parsed)
        self._bye_seen = False
        self._out = bytearray()  # credits not yet written

    def _peer_closed_flag(self) -> bool:
        return self._bye_seen

    def drain_socket(self) -> None:
        """Read whatever has arrived, straight into the slots."""
        if self.gone is not None:
            return
        sock = self.sock
        assert sock is not None
        buf = self.buf
        mv = buf.mv
        assert mv is not None
        while True:
            s = self._rx_seq % self.num_slots
            if self._rx_off == 0 and self.held[s]:
                # the slot is still in use: a correct sender has no credit for it, so nothing can be there
                try:
                    early = sock.recv(1, socket.MSG_PEEK)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    early = b""
                if early:
                    self.mark_gone(PeerDeadError, f"protocol error: message #{self._rx_seq} sent into a busy slot")
                    return
            base = buf.header_offset(s)
            try:
                n = sock.recv_into(mv[base + self._rx_off: base + self._rx_need])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.mark_gone(PeerDeadError, f"connection failed ({e.strerror or e})")
                return
            if n == 0:
                if self._rx_off:
                    self.mark_gone(PeerDeadError, f"process died in the middle of message #{self._rx_seq}")
                elif self._bye_seen:
                    self.mark_gone(PeerClosedError, "closed its side of the channel")
                else:
                    self.mark_gone(PeerDeadError, "process died (connection closed without goodbye)")
                return
            self._rx_off += n
            if self._rx_off < self._rx_need:
                continue
            if self._rx_need == HEADER_BYTES:
                try:
                    h = decode(mv, base)
                except ValueError as e:
                    self.mark_gone(PeerDeadError, f"protocol error: {e}")
                    return
                if h.flags & FLAG_BYE:
                    self._bye_seen = True
                    self._rx_off = 0
                    continue
                if h.seq != self._rx_seq or h.payload_bytes > self.slot_bytes:
                    self.mark_gone(PeerDeadError, f"protocol error: bad header for message #{self._rx_seq}")
                    return
                self._headers[s] = h
                if h.payload_bytes:
                    self._rx_need = HEADER_BYTES + h.payload_bytes
                    continue
            self._rx_seq += 1
            self._rx_off = 0
            self._rx_need = HEADER_BYTES

    def ready(self) -> bool:
        if self.next_seq < self._rx_seq:
            return True
        self.drain_socket()
        return self.next_seq < self._rx_seq

    def take(self, deadline: float) -> Message:
        k = self.next_seq
        s = k % self.num_slots
        h = self._headers[s]
        assert h is not None and h.seq == k
        self._headers[s] = None
        self.held[s] = True
        self.next_seq = k + 1
        return Message(self.peer, k, h.meta, self.buf.tensors(s, h.tensors), h.payload_bytes,
                       partial(self._release, k))

    def _write_credit(self, value: int) -> None:
        self._out += _CREDIT.pack(value)
        try:
            n = self.sock.send(self._out)  # type: ignore[union-attr]
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._out.clear()  # the peer is gone; nobody needs the credit
            return
        del self._out[:n]

    def _release(self, k: int) -> None:
        self.held[k % self.num_slots] = False
        if self.sock is not None and self.gone is None:
            self._write_credit(k + 1)

    def close(self) -> None:
        if self.gone is None and self.sock is not None:
            self._write_credit(BYE_CREDIT)
        self.close_socket()
        self.sock = None
        self.buf.release()
        try:
            self._mm.close()
        except BufferError:
            pass
