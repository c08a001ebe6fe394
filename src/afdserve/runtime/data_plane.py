"""The typed messages between attention and expert workers, over M2N (``afdserve.comm``).

Every message's header carries its ``Kind`` and the layer it belongs to (step, lane, layer); its
tensors are views of the receiver's registered slot until ``release``. Kinds:

* ``EXPERT_INPUT`` (attention -> expert): one layer's MoE input of a lane's step: the hidden states
  [n, H] and, with the attention-side gate, the top-k ids [n, k] (int32; ``num_experts``: routed to
  another worker, or a padding row of the fixed-capacity slot: ``runtime/dispatch.py``) and weights
  [n, k] float32; ``map_version``: the expert map the sender routed by.
* ``EXPERT_OUTPUT`` (expert -> attention): the partial sums [n, H] of this worker's experts.
* ``KV_BLOCKS`` (prefill attention worker -> decode attention worker, on the KV links of
  ``runtime/kv_transfer.py``): one layer's KV of ``n`` consecutive blocks of a prompt, as stored
  (keys and values or the latent [n, block_size, ...], then fp8 scales [n, heads]).
* ``CP_KV`` (attention -> attention, on the CP links of ``runtime/cp.py``): one layer's KV of a
  context-parallel prefill rank's pieces (keys and values [n, kv_heads, D], or the latent [n, D]),
  with their positions [n] int64, passed around the ring.
* ``CP_HIDDEN`` (helper rank -> owner, on the CP links): a rank's final hidden states [n, H] (the
  owner's LM head reads them for prompt logprobs).
* ``SHARD_QUERY`` (owner -> helper, on the shard links of ``runtime/cp.py``): a decode step's queries
  of one layer [n, heads, D] and their positions [n] int64, for the helper's shard of a sharded
  prompt's KV; ``SHARD_PARTIAL`` (helper -> owner): the attention over that shard, o [n, heads, Dv]
  and lse [n, heads] float32 (none where the helper holds no such shard).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from afdserve.comm import Message, Meta


class Kind(IntEnum):
    EXPERT_INPUT = 1
    EXPERT_OUTPUT = 2
    KV_BLOCKS = 3
    CP_KV = 4
    CP_HIDDEN = 5
    SHARD_QUERY = 6
    SHARD_PARTIAL = 7


class _InSlot:
    """A typed message over M2N: received, its tensors are views of the receiver's registered slot
    (``message``) until ``release``."""

    __slots__ = ()
    message: Message | None

    def release(self) -> None:
        if self.message is not None:
            self.message.release()


@dataclass(frozen=True, slots=True)
class LayerKey:
    """Which layer of which step a message belongs to (replies are matched by it)."""

    step: int
    lane: int
    layer: int
    part: int = 0  # the round of the layer's dispatch (a second pass: 1)


@dataclass(slots=True)
class ExpertInput(_InSlot):
    key: LayerKey
    map_version: int
    hidden: torch.Tensor
    ids: torch.Tensor | None  # None: the expert-side gate routes
    weights: torch.Tensor | None
    message: Message | None = None  # the slot it was read from (``release``)

    def meta(self) -> Meta:
        k = self.key
        return Meta(step=k.step, microbatch=k.lane, layer=k.layer, num_tokens=int(self.hidden.shape[0]),
                    tag=self.map_version, ints=(k.part,) if k.part else (), kind=Kind.EXPERT_INPUT)

    def tensors(self) -> list[torch.Tensor]:
        return [self.hidden] if self.ids is None else [self.hidden, self.ids, self.weights]


@dataclass(slots=True)
class ExpertOutput(_InSlot):
    key: LayerKey
    partial: torch.Tensor
    message: Message | None = None

    def meta(self) -> Meta:
        k = self.key
        return Meta(step=k.step, microbatch=k.lane, layer=k.layer, num_tokens=int(self.partial.shape[0]),
                    ints=(k.part,) if k.part else (), kind=Kind.EXPERT_OUTPUT)

    def tensors(self) -> list[torch.Tensor]:
        return [self.partial]


@dataclass(slots=True)
class KVBlocks(_InSlot):
    """Blocks ``first``.. of the prompt of decode reservation ``handle``, for ``layer``: after it the
    receiver holds that layer's KV of the prompt's first ``end`` tokens (from its reserved start)."""

    handle: int
    layer: int
    first: int  # the sequence's block index of parts' first block
    end: int
    stamp_ns: int  # time.time_ns() when the layer's attention ended at the sender
    start_ns: int  # ... when the prefill began there
    parts: list[torch.Tensor]
    message: Message | None = None

    def meta(self) -> Meta:
        return Meta(step=self.handle, layer=self.layer, num_tokens=int(self.parts[0].shape[0]),
                    ints=(self.first, self.end, self.stamp_ns, self.start_ns), kind=Kind.KV_BLOCKS)

    def tensors(self) -> list[torch.Tensor]:
        return self.parts


@dataclass(slots=True)
class RingKV(_InSlot):
    """CP prefill ``handle``'s KV of ``layer`` computed by rank ``origin``: ``parts`` (keys and values,
    or the latent) and their ``positions``."""

    handle: int
    layer: int
    origin: int
    parts: list[torch.Tensor]
    positions: torch.Tensor
    message: Message | None = None

    def meta(self) -> Meta:
        return Meta(step=self.handle, layer=self.layer, num_tokens=int(self.positions.shape[0]), ints=(self.origin,),
                    kind=Kind.CP_KV)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.parts, self.positions]


@dataclass(slots=True)
class CPHidden(_InSlot):
    """CP prefill ``handle``'s final hidden states of rank ``origin``'s positions (piece order)."""

    handle: int
    origin: int
    hidden: torch.Tensor
    message: Message | None = None

    def meta(self) -> Meta:
        return Meta(step=self.handle, num_tokens=int(self.hidden.shape[0]), ints=(self.origin,), kind=Kind.CP_HIDDEN)

    def tensors(self) -> list[torch.Tensor]:
        return [self.hidden]


@dataclass(slots=True)
class ShardQuery(_InSlot):
    """Step ``step`` (the owner's count) of sharded prompt ``handle``: queries ``q`` of ``layer`` at
    ``positions``."""

    step: int
    handle: int
    layer: int
    q: torch.Tensor
    positions: torch.Tensor
    message: Message | None = None

    def meta(self) -> Meta:
        return Meta(step=self.step, layer=self.layer, num_tokens=int(self.positions.shape[0]), ints=(self.handle,),
                    kind=Kind.SHARD_QUERY)

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.positions]


@dataclass(slots=True)
class ShardPartial(_InSlot):
    """The answer to a ``ShardQuery`` (same step, handle, layer): (o, lse), or None where the helper
    holds no shard of ``handle``."""

    step: int
    handle: int
    layer: int
    partial: tuple[torch.Tensor, torch.Tensor] | None
    message: Message | None = None

    def meta(self) -> Meta:
        return Meta(step=self.step, layer=self.layer, ints=(self.handle,), kind=Kind.SHARD_PARTIAL)

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.partial is None else list(self.partial)


def read_cp(msg: Message) -> RingKV | CPHidden | ShardQuery | ShardPartial:
    """The typed message of the CP links a received message holds (views of the slot until ``release``)."""
    m, t = msg.meta, msg.tensors
    if m.kind == Kind.CP_KV and len(t) in (2, 3) and len(m.ints) == 1:
        return RingKV(m.step, m.layer, m.ints[0], list(t[:-1]), t[-1], msg)
    if m.kind == Kind.CP_HIDDEN and len(t) == 1 and len(m.ints) == 1:
        return CPHidden(m.step, m.ints[0], t[0], msg)
    if m.kind == Kind.SHARD_QUERY and len(t) == 2 and len(m.ints) == 1:
        return ShardQuery(m.step, m.ints[0], m.layer, t[0], t[1], msg)
    if m.kind == Kind.SHARD_PARTIAL and len(t) in (0, 2) and len(m.ints) == 1:
        return ShardPartial(m.step, m.ints[0], m.layer, (t[0], t[1]) if t else None, msg)
    msg.release()
    raise ValueError(f"message from {msg.peer!r} of kind {m.kind} on the CP links is not CP KV or hidden states")


def read_kv(msg: Message) -> KVBlocks:
    """The KV blocks a message of the KV links holds (views of the slot until ``release``)."""
    m = msg.meta
    if m.kind != Kind.KV_BLOCKS or len(m.ints) != 4:
        msg.release()
        raise ValueError(f"message from {msg.peer!r} of kind {m.kind} on the KV links is not KV blocks")
    return KVBlocks(m.step, m.layer, m.ints[0], m.ints[1], m.ints[2], m.ints[3], list(msg.tensors), msg)


def read(msg: Message) -> ExpertInput | ExpertOutput:
    """The typed message a received M2N message holds (its tensors stay views of the slot)."""
    m, t = msg.meta, msg.tensors
    key = LayerKey(m.step, m.microbatch, m.layer, m.ints[0] if m.ints else 0)
    if m.kind == Kind.EXPERT_INPUT and len(t) in (1, 3):
        return ExpertInput(key, m.tag, t[0], t[1] if len(t) == 3 else None, t[2] if len(t) == 3 else None, msg)
    if m.kind == Kind.EXPERT_OUTPUT and len(t) == 1:
        return ExpertOutput(key, t[0], msg)
    msg.release()
    raise ValueError(f"message from {msg.peer!r} of kind {m.kind} with {len(t)} tensors is not a data-plane message")
