"""Errors of the M2N library. Every error about a peer names the peer."""

from __future__ import annotations

from afdserve.errors import AfdServeError


class CommError(AfdServeError):
    """Base class of afdserve.comm's errors."""


class ConnectError(CommError):
    """A group could not be connected (peer never showed up, handshake failed, transport impossible)."""


class PayloadTooLargeError(CommError, ValueError):
    """A message does not fit in the receiver's registered slot (or exceeds the header's limits)."""


class SlotBusyError(CommError):
    """The slot the next message needs is still held by an unreleased Message of this process."""


class PeerError(CommError):
    """Something is wrong with one peer (or, for ``recv_any``, with the peers waited on).

    ``peer`` is the peer's name (comma-joined names for ``recv_any``), ``peers`` the tuple of
    names, ``reason`` a human-readable cause.
    """

    def __init__(self, peer: str | tuple[str, ...], reason: str) -> None:
        self.peers: tuple[str, ...] = (peer,) if isinstance(peer, str) else tuple(peer)
        self.peer: str = ", ".join(self.peers)
        self.reason = reason
        super().__init__(f"peer {self.peer!r}: {reason}")

    def __reduce__(self):  # keep pickling (e.g. through a multiprocessing queue) working
        return (type(self), (self.peers if len(self.peers) != 1 else self.peer, self.reason))


class PeerDeadError(PeerError):
    """The peer's process is gone (connection reset / closed without goodbye, mid-message EOF)."""


class PeerClosedError(PeerError):
    """The peer closed its side of the channel in an orderly way; no more messages will come."""


class PeerTimeoutError(PeerError, TimeoutError):
    """The peer did not deliver (or free a slot) before the deadline: stalled, slow, or absent."""
