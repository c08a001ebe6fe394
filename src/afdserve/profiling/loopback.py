"""Loop-back links: the attention worker's links to its expert workers, without expert workers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["LoopbackLinks"]


@dataclass(frozen=True)
class _Meta:
    step: int
    microbatch: int
    layer: int
    ints: tuple[int, ...] = ()


class _Reply:
    __slots__ = ("tensors", "meta")

    def __init__(self, tensors: list[torch.Tensor], meta: _Meta):
        self.tensors, self.meta = tensors, meta

    def release(self) -> None:
        pass


class LoopbackLinks:
    """Stands in for the runtime's ``Links``: a ``send`` is recorded (no copy; sends are measured
    with the transport) and the matching ``recv`` returns zeros of the size the expert worker would
    send back.  ``on_recv`` runs inside the recv, where the worker would wait for the experts."""

    def __init__(self, hidden: int, dtype: torch.dtype, on_recv: Callable[[], None] | None = None):
        self.hidden, self.dtype, self.on_recv = hidden, dtype, on_recv
        self.pending: dict[int, list[tuple[int, _Meta]]] = {}

    def send(self, peer: int, tensors: list[torch.Tensor], meta: tuple[int, int, int, int],
             ints: tuple[int, ...] = ()) -> None:
        step, mb, layer, _ = meta  # the reply answers this (step, micro-batch, layer), as an expert's does
        self.pending.setdefault(peer, []).append((int(tensors[0].shape[0]), _Meta(step, mb, layer)))

    def recv(self, peer: int, timeout: float) -> _Reply:
        n, meta = self.pending[peer].pop(0)
        if self.on_recv is not None:
            self.on_recv()
        return _Reply([torch.zeros(n, self.hidden, dtype=self.dtype)], meta)

    def try_recv(self, peers: list[int]) -> tuple[int, _Reply] | None:
        return (peers[0], self.recv(peers[0], 0.0)) if self.pending.get(peers[0]) else None

    def recv_any(self, peers: list[int], timeout: float) -> tuple[int, _Reply]:
        return peers[0], self.recv(peers[0], timeout)

    def close(self) -> None:
        pass
