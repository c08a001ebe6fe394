"""What travels with a payload (Meta) and what a receiver gets back (Message)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch


class Meta(NamedTuple):
    """Small metadata carried in the message header (signed 64-bit integers; ``kind`` 32-bit).

    ``kind`` says what the message is, in the user's own numbering (the runtime's data plane:
    ``afdserve.runtime.data_plane.Kind``). ``ints`` holds up to ``MAX_META_INTS`` (48) further
    integers; anything larger belongs in a tensor. Immutable (a NamedTuple: cheap to build).
    """

    step: int = 0
    microbatch: int = 0
    layer: int = 0
    num_tokens: int = 0
    tag: int = 0
    ints: tuple[int, ...] = ()
    kind: int = 0


@dataclass(eq=False, slots=True)
class Message:
    """One received message.

    ``tensors`` are views into the receiver's registered slot: valid until ``release()``; clone what
    must outlive it. Release every Message (or use it as a context manager), otherwise the sender
    runs out of slots.
    """

    peer: str
    seq: int
    meta: Meta
    tensors: list[torch.Tensor]
    payload_bytes: int
    _release: Callable[[], None] | None = field(default=None, repr=False)

    def release(self) -> None:
        """Give the slot back to the sender (idempotent). The tensors must not be used afterwards."""
        fn, self._release = self._release, None
        if fn is not None:
            fn()

    @property
    def released(self) -> bool:
        return self._release is None

    def __enter__(self) -> "Message":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
