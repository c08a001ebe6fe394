"""Communicator: one worker's end of an M2N group (it may send to some peers and receive from others).

    comm = Communicator("attn0", store, CommConfig(slot_bytes=..., num_slots=4), group="layers")
    comm.connect(send_to=["exp0", "exp1"], recv_from=["exp0", "exp1"])
    comm.send("exp0", [hidden, topk_ids], Meta(microbatch=1, layer=3, num_tokens=T))
    with comm.recv("exp0") as msg:         # msg.tensors are views into the registered slot
        out = msg.tensors[0].clone()         # copy only what must outlive release()

A Communicator is not thread-safe: use it from one thread at a time (two threads can use two
Communicators of different groups, e.g. one for dispatch and one for combine).
"""

from __future__ import annotations

import time
import weakref
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from afdserve.comm.channel import RecvChannel, SendChannel
from afdserve.comm.config import CommConfig
from afdserve.comm.errors import PeerError, PeerTimeoutError, SlotBusyError
from afdserve.comm.handshake import Links, establish
from afdserve.comm.message import Message, Meta
from afdserve.comm.progress import Progress

_now = time.perf_counter
Peer = str | int
_NO_META = Meta()


def _close_links(links: Links, progress: Progress) -> None:
    for ch in list(links.send.values()) + list(links.recv.values()):
        progress.discard(ch)
    progress.bell = None
    links.close()


class Communicator:
    def __init__(self, name: Peer, store: dist.Store, config: CommConfig | None = None, *,
                 group: str = "default") -> None:
        self.name = str(name)
        self.group = group
        self.config = config if config is not None else CommConfig()
        self._store = store
        self._links = Links()
        self._progress = Progress(self.config.spin_s)
        self._rr = 0
        self._finalizer = weakref.finalize(self, _close_links, self._links, self._progress)

    # -- set-up ------------------------------------------------------------------------------------
    def connect(self, send_to: Sequence[Peer] = (), recv_from: Sequence[Peer] = (),
                timeout: float | None = None) -> "Communicator":
        """Connect to these peers (only); registers one buffer per incoming pair. Call once."""
        if self._links.send or self._links.recv:
            raise RuntimeError(f"communicator {self.name!r} is already connected")
        snd, rcv = [str(p) for p in send_to], [str(p) for p in recv_from]
        for lst, what in ((snd, "send_to"), (rcv, "recv_from")):
            if len(set(lst)) != len(lst):
                raise ValueError(f"{what} lists a peer twice: {lst}")
            if self.name in lst:
                raise ValueError(f"{what} lists this communicator itself ({self.name!r})")
        links = establish(self.name, self.group, self._store, self.config, snd, rcv,
                          self.config.connect_timeout_s if timeout is None else timeout)
        self._links.send.update(links.send)
        self._links.recv.update(links.recv)
        self._links.bell, self._links.peer_bells = links.bell, links.peer_bells
        self._progress.bell = links.bell
        for ch in list(links.send.values()) + list(links.recv.values()):
            self._progress.add(ch)
        return self

    @property
    def send_peers(self) -> tuple[str, ...]:
        return tuple(self._links.send)

    @property
    def recv_peers(self) -> tuple[str, ...]:
        return tuple(self._links.recv)

    def transport(self, peer: Peer, direction: str = "send") -> str:
        """'shm', 'cuda_ipc', 'tcp' or 'torch': what the pair to (direction='send') / from ('recv') ``peer`` uses."""
        return self._chan(str(peer), direction).transport

    def capacity(self, peer: Peer) -> int:
        """Payload bytes one message to ``peer`` may carry (the receiver's slot size)."""
        return self._chan(str(peer), "send").slot_bytes

    def _chan(self, peer: str, direction: str):
        table = self._links.send if direction == "send" else self._links.recv
        ch = table.get(peer)
        if ch is None:
            raise ValueError(f"{self.name!r} has no {direction} channel with {peer!r} "
                             f"(connected: {sorted(table)})")
        return ch

    # -- data path ---------------------------------------------------------------------------------
    def send(self, peer: Peer, tensors: torch.Tensor | Sequence[torch.Tensor] = (), meta: Meta | None = None,
             *, timeout: float | None = None) -> None:
        """Copy the tensors into ``peer``'s next registered slot and signal completion.

        Blocks only while all of the pair's slots are held by the receiver, at most ``timeout``
        seconds (default ``config.deadline_s``); the tensors may be reused as soon as it returns.
        """
        ch: SendChannel = self._links.send.get(str(peer)) or self._chan(str(peer), "send")
        if isinstance(tensors, torch.Tensor):
            tensors = (tensors,)
        deadline = _now() + (self.config.deadline_s if timeout is None else timeout)
        ch.send(tensors, _NO_META if meta is None else meta, deadline, self._progress)

    def no_spin_when(self, fn: Callable[[], bool] | None) -> None:
        """Waits stop spinning and sleep while ``fn()`` is true (this core is wanted elsewhere);
        None: spin as budgeted."""
        self._progress.no_spin = fn

    def recv(self, peer: Peer, *, timeout: float | None = None) -> Message:
        """The next message from ``peer`` (in order), waiting at most ``timeout`` seconds."""
        ch: RecvChannel = self._links.recv.get(str(peer)) or self._chan(str(peer), "recv")
        deadline = _now() + (self.config.deadline_s if timeout is None else timeout)
        return ch.recv(deadline, self._progress)

    def recv_any(self, peers: Sequence[Peer] | None = None, *, timeout: float | None = None) -> Message:
        """The next message from whichever of ``peers`` (default: all) delivers first."""
        names = self.recv_peers if peers is None else [str(p) for p in peers]
        if not names:
            raise ValueError("recv_any needs at least one peer")
        chans = [self._links.recv.get(n) or self._chan(n, "recv") for n in names]
        n = len(chans)
        self._rr = (self._rr + 1) % n
        chans = chans[self._rr:] + chans[: self._rr]
        for ch in chans:
            ch.check()
        free = [ch for ch in chans if not ch.held[ch.next_seq % ch.num_slots]]
        if not free:
            chans[0].check_slot()
            raise SlotBusyError("all candidate pairs have their next slot held")  # pragma: no cover
        deadline = _now() + (self.config.deadline_s if timeout is None else timeout)
        found: list[RecvChannel] = []

        def ready() -> bool:
            for ch in free:
                if ch.ready():
                    found.append(ch)
                    return True
            return False

        def check() -> None:
            for ch in free:
                ch.check()

        def timeout_error() -> PeerTimeoutError:
            return PeerTimeoutError(tuple(c.peer for c in free), "no message arrived before the deadline")

        def busy() -> bool:
            for ch in free:
                if ch.busy():
                    return True
            return False

        self._progress.wait(ready, check, deadline, timeout_error, busy=busy,
                            futex_ok=all(ch.futex_ok for ch in free))
        return found[-1].take(deadline)

    def try_recv(self, peers: Sequence[Peer] | None = None) -> Message | None:
        """The next message of the first of ``peers`` (default: all) that has one delivered, without
        waiting (None if none has); raises like ``recv`` for a dead or closed peer."""
        names = self.recv_peers if peers is None else [str(p) for p in peers]
        if not names:
            raise ValueError("try_recv needs at least one peer")
        ch = self._first_delivered(names)
        return None if ch is None else ch.take(_now() + self.config.deadline_s)

    def pending(self, peers: Sequence[Peer] | None = None) -> bool:
        """Whether one of ``peers`` (default: all) has a message delivered or has failed, without
        taking anything (a cheap check between pieces of other work)."""
        try:
            return self._first_delivered(self.recv_peers if peers is None else [str(p) for p in peers]) is not None
        except PeerError:
            return True

    def _first_delivered(self, names: Sequence[str]) -> RecvChannel | None:
        """The first channel of ``names`` whose next message has arrived (raises for a failed peer)."""
        for n in names:
            ch = self._links.recv.get(n) or self._chan(n, "recv")
            ch.check()
            if not ch.held[ch.next_seq % ch.num_slots] and ch.ready():
                return ch
        return None

    def progress(self) -> None:
        """Move whatever TCP data has arrived into registered slots (optional; waits do it anyway)."""
        self._progress.pump(0)

    # -- teardown ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Orderly close of every pair (peers then get PeerClosedError); idempotent."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Communicator({self.name!r}, group={self.group!r}, send_to={list(self.send_peers)}, "
                f"recv_from={list(self.recv_peers)})")


def connect(name: Peer, store: dist.Store, send_to: Sequence[Peer] = (), recv_from: Sequence[Peer] = (),
            config: CommConfig | None = None, *, group: str = "default",
            timeout: float | None = None) -> Communicator:
    """Create a Communicator and connect it (see ``Communicator.connect``)."""
    return Communicator(name, store, config, group=group).connect(send_to, recv_from, timeout)
