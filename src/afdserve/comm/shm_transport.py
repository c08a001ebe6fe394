"""Shared-memory transport: the sender copies straight into the receiver's slot.

Segment layout (owned by the receiver): a 4 KiB control block of 64-bit words, then the slots.
Completion is a sequence word per slot: the sender writes header + payload, then stores
``FILLED[s] = seq + 1``; the receiver releases with ``FREED[s] = seq + 1``. After either store the
writer notifies the other side's doorbell (``doorbell.py``: a futex wake, or a byte on the pair's
socket, only if that side announced it sleeps). Words written by different sides live in
different cache lines.

Ordering: the payload stores precede the completion store in program order and x86-64 keeps stores
in order (TSO); ``transport="auto"`` therefore picks shared memory only on x86-64.

Where the payload lives is a strategy (``Payload``): here, in the segment beside its header
(``HostPayload``); the CUDA IPC transport (``cuda_ipc.py``) runs this same protocol with the payload
in the receiver's device memory, so the segment then carries the headers and completion words only
(its slots' host payload area may be empty: the control block records its size).
"""

from __future__ import annotations

import secrets
import socket
from functools import partial
from typing import Protocol, Sequence

import numpy as np
import torch

from afdserve.comm.channel import RecvChannel, SendChannel
from afdserve.comm.doorbell import NO_SOCKET, Doorbell
from afdserve.comm.header import TensorDesc, decode, encode_into, plan
from afdserve.comm.message import Message, Meta
from afdserve.comm.progress import Progress
from afdserve.comm.shm import Segment
from afdserve.comm.slots import SlotBuffer, slot_stride
from afdserve.comm.errors import PeerDeadError

CONTROL_BYTES = 4096
MAGIC = 0xAFD5_4D00
# word indices into the control block
C_MAGIC, C_NONCE, C_SLOTS, C_SLOT_BYTES = 0, 1, 2, 3
C_SENDER_CLOSED = 24
C_RECEIVER_CLOSED = 32
C_WRITING = 40  # written by the sender: seq + 1 of the message it is copying right now
C_FILLED = 64  # [MAX_SLOTS], written by the sender
C_FREED = 128  # [MAX_SLOTS], written by the receiver


def segment_bytes(num_slots: int, slot_bytes: int) -> int:
    return CONTROL_BYTES + num_slots * slot_stride(slot_bytes)


def _control(seg: Segment) -> np.ndarray:
    return np.frombuffer(seg.mm, dtype=np.uint64, count=CONTROL_BYTES // 8)


def create_pair_segment(num_slots: int, slot_bytes: int) -> tuple[Segment, int]:
    """Receiver side: create the segment of one incoming pair; returns it and the nonce to verify."""
    seg = Segment.create(segment_bytes(num_slots, slot_bytes))
    nonce = secrets.randbits(63)
    ctl = _control(seg)
    ctl[C_NONCE], ctl[C_SLOTS], ctl[C_SLOT_BYTES] = nonce, num_slots, slot_bytes
    ctl[C_MAGIC] = MAGIC
    del ctl
    return seg, nonce


def attach_pair_segment(name: str, num_slots: int, slot_bytes: int, nonce: int) -> Segment:
    """Sender side: map the receiver's segment and check it is the one announced."""
    seg = Segment.attach(name, segment_bytes(num_slots, slot_bytes))
    ctl = _control(seg)
    ok = (int(ctl[C_MAGIC]) == MAGIC and int(ctl[C_NONCE]) == nonce and int(ctl[C_SLOTS]) == num_slots
          and int(ctl[C_SLOT_BYTES]) == slot_bytes)
    del ctl
    if not ok:
        seg.close()
        raise ValueError(f"segment {name} does not carry the expected control block")
    return seg


class Payload(Protocol):
    """Where a pair's payloads live and how they get there (the headers stay in the segment)."""

    transport: str
    dies_with_peer: bool  # the memory is the peer process's: using it after that process died is unsafe

    def write(self, slot: int, tensors: Sequence[torch.Tensor], descs: Sequence[TensorDesc], reuse: bool) -> None:
        """Sender: copy the tensors into the slot (``reuse``: the slot held an earlier message)."""

    def views(self, slot: int, descs: Sequence[TensorDesc]) -> list[torch.Tensor]:
        """Receiver: the message's tensors, in place, readable once the completion word was seen."""

    def consumed(self, slot: int) -> None:
        """Receiver: the slot's tensors are no longer read (called just before FREED is stored)."""

    def close(self) -> None: ...


class HostPayload:
    """The payload in the segment, after its header: the copy is done when ``write`` returns."""

    transport = "shm"
    dies_with_peer = False  # a mapping of the segment outlives its creator

    def __init__(self, buf: SlotBuffer) -> None:
        self.buf = buf

    def write(self, slot: int, tensors: Sequence[torch.Tensor], descs: Sequence[TensorDesc], reuse: bool) -> None:
        self.buf.write(slot, tensors, descs)

    def views(self, slot: int, descs: Sequence[TensorDesc]) -> list[torch.Tensor]:
        return self.buf.tensors(slot, descs)

    def consumed(self, slot: int) -> None:
        pass

    def close(self) -> None:
        pass


class _ShmEnd:
    """What both ends of a shared-memory pair have (listed first among the bases, so that its
    ``futex_ok`` wins over ``Channel``'s)."""

    futex_ok = True  # waits on this pair can sleep on the doorbell futex
    ring: "object"

    def _init_mem(self, seg: Segment, num_slots: int, peer_bell: Doorbell, payload: Payload | None) -> None:
        self.seg = seg
        self.peer_bell = peer_bell
        self.ctl = _control(seg)
        self.buf = SlotBuffer(num_slots, int(self.ctl[C_SLOT_BYTES]), mem=seg.mm, base=CONTROL_BYTES)
        self.payload: Payload = HostPayload(self.buf) if payload is None else payload
        self.transport = self.payload.transport

    def _drop_mem(self) -> None:
        self.payload.close()
        self.buf.release()
        self.ctl = np.zeros(CONTROL_BYTES // 8, dtype=np.uint64)
        self.seg.close()


class ShmSendChannel(_ShmEnd, SendChannel):
    transport = "shm"

    def __init__(self, peer: str, sock: socket.socket, seg: Segment, num_slots: int, slot_bytes: int,
                 peer_bell: Doorbell, payload: Payload | None = None) -> None:
        super().__init__(peer, sock, num_slots, slot_bytes)
        self._init_mem(seg, num_slots, peer_bell, payload)

    def _peer_closed_flag(self) -> bool:
        return bool(self.ctl[C_RECEIVER_CLOSED])

    def send(self, tensors: Sequence[torch.Tensor], meta: Meta, deadline: float, progress: Progress) -> None:
        descs, total = plan(tensors, self.slot_bytes, self.peer)
        if self.payload.dies_with_peer:
            self.drain_socket()  # notice a dead receiver now, not after a copy into its freed memory
        self.check()
        k = self.next_seq
        s = k % self.num_slots
        need = k - self.num_slots + 1
        ctl = self.ctl
        if need > 0 and int(ctl[C_FREED + s]) < need:
            progress.wait(lambda: int(ctl[C_FREED + s]) >= need, self.check, deadline,
                          lambda: self._credit_timeout(k), futex_ok=True)
        buf = self.buf
        ctl[C_WRITING] = k + 1  # lets a spinning receiver keep spinning through the copy
        encode_into(buf.mv, buf.header_offset(s), k, meta, descs, total)
        self.payload.write(s, tensors, descs, need > 0)
        ctl[C_FILLED + s] = k + 1  # the completion ("write with immediate")
        self.next_seq = k + 1
        self.peer_bell.notify(self.ring)

    def close(self) -> None:
        self.ctl[C_SENDER_CLOSED] = 1
        self.close_socket()  # EOF for a peer sleeping in poll ...
        self.peer_bell.notify(NO_SOCKET)  # ... and a wake-up for one sleeping on its futex
        self._drop_mem()


class ShmRecvChannel(_ShmEnd, RecvChannel):
    transport = "shm"

    def __init__(self, peer: str, sock: socket.socket, seg: Segment, num_slots: int, slot_bytes: int,
                 peer_bell: Doorbell, payload: Payload | None = None) -> None:
        super().__init__(peer, sock, num_slots, slot_bytes)
        self._init_mem(seg, num_slots, peer_bell, payload)

    def _peer_closed_flag(self) -> bool:
        return bool(self.ctl[C_SENDER_CLOSED])

    def ready(self) -> bool:
        k = self.next_seq
        return int(self.ctl[C_FILLED + k % self.num_slots]) == k + 1

    def busy(self) -> bool:
        return int(self.ctl[C_WRITING]) == self.next_seq + 1

    def take(self, deadline: float) -> Message:
        k = self.next_seq
        s = k % self.num_slots
        buf = self.buf
        h = decode(buf.mv, buf.header_offset(s))
        if h.seq != k:
            self.mark_gone(PeerDeadError, f"protocol error: slot {s} holds message #{h.seq}, expected #{k}")
            self.check()
        self.held[s] = True
        self.next_seq = k + 1
        return Message(self.peer, k, h.meta, self.payload.views(s, h.tensors), h.payload_bytes,
                       partial(self._release, k))

    def _release(self, k: int) -> None:
        s = k % self.num_slots
        self.held[s] = False
        self.payload.consumed(s)
        ctl = self.ctl
        ctl[C_FREED + s] = k + 1
        self.peer_bell.notify(self.ring)

    def close(self) -> None:
        self.ctl[C_RECEIVER_CLOSED] = 1
        self.close_socket()
        self.peer_bell.notify(NO_SOCKET)
        self._drop_mem()
