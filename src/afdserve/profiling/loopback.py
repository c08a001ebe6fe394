"""Loop-back links: the attention worker's links to its expert workers, without expert workers."""

from __future__ import annotations

from collections.abc import Callable

import torch

from afdserve.comm import Message
from afdserve.runtime import ExpertInput, ExpertOutput

__all__ = ["LoopbackLinks"]


class LoopbackLinks:
    """Stands in for the runtime's ``Links``: a ``send`` is recorded (no copy; sends are measured
    with the transport) and the matching ``recv`` returns zeros of the size the expert worker would
    send back.  ``on_recv`` runs inside the recv, where the worker would wait for the experts."""

    def __init__(self, hidden: int, dtype: torch.dtype, on_recv: Callable[[], None] | None = None):
        self.hidden, self.dtype, self.on_recv = hidden, dtype, on_recv
        self.pending: dict[int, list[ExpertInput]] = {}

    def send(self, peer: int, msg: ExpertInput) -> None:
        self.pending.setdefault(peer, []).append(msg)  # answered with the layer's key, as an expert does

    def recv(self, peer: int, timeout: float) -> Message:
        inp = self.pending[peer].pop(0)
        if self.on_recv is not None:
            self.on_recv()
        out = ExpertOutput(inp.key, torch.zeros(inp.hidden.shape[0], self.hidden, dtype=self.dtype))
        return Message(f"expert{peer}", 0, out.meta(), out.tensors(), 0)

    def try_recv(self, peers: list[int]) -> tuple[int, Message] | None:
        return (peers[0], self.recv(peers[0], 0.0)) if self.pending.get(peers[0]) else None

    def recv_any(self, peers: list[int], timeout: float) -> tuple[int, Message]:
        return peers[0], self.recv(peers[0], timeout)

    def close(self) -> None:
        pass
