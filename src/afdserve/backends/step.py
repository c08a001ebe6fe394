"""A step's batch as the scheduler laid it out (``StepLayout``, host arrays), the persistent buffers
its device tensors are staged in (``StepBuffers``), and the context every layer of the step reads
(``AttnContext``, built once per step by the attention backend's ``prepare``; ``PagedContext`` for
kernels that read the paged cache in place; ``CPContext`` for a context-parallel prefill step;
``ShardedContext`` for a decode step over KV sharded by one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from afdserve.backends.base import Ring, ShardPeers
    from afdserve.backends.pytorch.ring import RingAttention


@dataclass(frozen=True)
class StepLayout:
    """The flat batch of a step: sequence i has ``query_lens[i]`` new tokens, the last of its
    ``kv_lens[i]`` tokens after the step; its cache blocks are row i of ``block_table`` (int32
    [S, B]; -1: given back, or past its blocks), positions ``[j * block_size, (j + 1) * block_size)``
    in block j. Everything else is derived from these on the host, once (``of``)."""

    query_lens: np.ndarray  # int64 [S]
    kv_lens: np.ndarray  # int64 [S]
    block_table: np.ndarray  # int32 [S, B]
    block_size: int
    positions: np.ndarray  # int64 [T]: each new token's position
    slot_mapping: np.ndarray  # int64 [T]: each new token's cache slot (block * block_size + offset)
    first_rows: np.ndarray  # int64 [S]: each sequence's first row in the flat batch
    decode_seqs: np.ndarray  # int64 [D]: the sequences with one new token

    @staticmethod
    def of(query_lens, kv_lens, block_table: np.ndarray, block_size: int) -> "StepLayout":
        q = np.asarray(query_lens, dtype=np.int64)
        kv = np.asarray(kv_lens, dtype=np.int64)
        table = np.asarray(block_table)
        if table.dtype != np.int32 or table.ndim != 2 or table.shape[0] != q.shape[0] or q.shape != kv.shape:
            raise ValueError(f"step layout: {q.shape[0]} query lengths, {kv.shape[0]} context lengths and an int32 "
                             f"[{q.shape[0]}, blocks] table expected, got {table.dtype} {table.shape}")
        if q.size and (q.min() < 1 or (kv < q).any()):
            raise ValueError("step layout: every sequence needs a new token and a context of at least its new tokens")
        s = q.shape[0]
        if int(q.sum()) == s:  # a pure decode step: one token per sequence, at its last position
            seq_of = first = np.arange(s, dtype=np.int64)
            positions = kv - 1
        else:
            seq_of = np.repeat(np.arange(s, dtype=np.int64), q)
            first = np.cumsum(q) - q
            positions = (kv - q)[seq_of] + np.arange(int(q.sum()), dtype=np.int64) - first[seq_of]
        slots = table[seq_of, positions // block_size].astype(np.int64) * block_size + positions % block_size
        return StepLayout(q, kv, table, block_size, positions, slots, first, np.flatnonzero(q == 1))

    @staticmethod
    def from_blocks(query_lens, kv_lens, tables: list[list[int]], block_size: int) -> "StepLayout":
        """``of`` from per-sequence block lists (padded with -1; at least 2 columns)."""
        arr = np.full((len(tables), max(2, max((len(t) for t in tables), default=0))), -1, dtype=np.int32)
        for i, t in enumerate(tables):
            arr[i, : len(t)] = t
        return StepLayout.of(query_lens, kv_lens, arr, block_size)

    @property
    def num_seqs(self) -> int:
        return int(self.query_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_decode(self) -> int:
        return int(self.decode_seqs.shape[0])

    @property
    def is_decode(self) -> bool:
        """Every sequence has one new token."""
        return self.num_decode == self.num_seqs > 0


class StepBuffers:
    """Persistent buffers a step's host arrays are staged in: one host tensor per name (pinned where
    the device is not the CPU), grown by doubling and reused every step, and its copy on the device
    (the host tensor itself on the CPU), written with non-blocking copies. A runner keeps one set per
    step in flight; before a set is written again, the copies of its previous step have finished."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.on_host = self.device.type == "cpu"
        self._host: dict[str, torch.Tensor] = {}
        self._arrays: dict[str, np.ndarray] = {}  # the host tensors as numpy arrays (one memory)
        self._dev: dict[str, torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None

    def begin(self) -> None:
        """A new step: the previous step's copies out of the host buffers are done."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def stage(self, name: str, array: np.ndarray) -> torch.Tensor:
        """``array``'s values on the device, in buffer ``name`` (a view of its first elements, shaped
        like ``array``). On the CPU the values are copied by numpy into the buffer's array (a torch
        copy of a step's small arrays costs several times more, each of them every step)."""
        n = int(array.size)
        src = np.ascontiguousarray(array)
        host = self._host.get(name)
        if host is None or self._arrays[name].dtype != src.dtype or host.numel() < n:
            size = max(n, 1 if host is None else 2 * host.numel())
            host = torch.empty(size, dtype=torch.from_numpy(src[:0].reshape(0)).dtype,
                               pin_memory=not self.on_host and torch.cuda.is_available())
            self._host[name], self._arrays[name] = host, host.numpy()
            if not self.on_host:
                self._dev[name] = torch.empty(size, dtype=host.dtype, device=self.device)
        if self.on_host:
            dst = self._arrays[name][:n].reshape(src.shape)
            np.copyto(dst, src)
            return torch.from_numpy(dst)
        view = host[:n].view(src.shape)
        view.copy_(torch.from_numpy(src))
        dev = self._dev[name][:n].view(src.shape)
        dev.copy_(view, non_blocking=True)
        return dev

    def end(self) -> None:
        """Every array of the step is staged: later writes wait for these copies (``begin``)."""
        if not self.on_host and self.device.type == "cuda":
            self._copied = torch.cuda.Event()  # on the copies' stream: the device's, not the current device's
            self._copied.record(torch.cuda.current_stream(self.device))


@dataclass
class AttnContext:
    """What every layer of a step reads, built once (``AttentionBackend.prepare``, then the model adds
    the rotary tables): tensors on the model's device, nothing read back to the host afterwards.
    Backends add the fields their kernels read (subclasses)."""

    layout: StepLayout  # the host arrays it was built from (layers read the fields below)
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    num_tokens: int
    is_decode: bool  # every sequence has one new token
    cos: torch.Tensor | None = None  # [T, rotary_dim] in the model's dtype
    sin: torch.Tensor | None = None
    first_rows: torch.Tensor | None = None  # [S] int64: each sequence's first row (the FP8 cache's writes)


@dataclass
class PagedContext(AttnContext):
    """The context of kernels that read the paged cache in place through the block tables (the cpu
    and triton attention backends): the tables, each sequence's context length and its first query
    row, as int32."""

    block_tables: torch.Tensor | None = None  # [S, B] int32
    kv_lens: torch.Tensor | None = None  # [S] int32: keys after the step
    cu_q: torch.Tensor | None = None  # [S + 1] int32: cumulative new tokens
    block_size: int = 0

    @classmethod
    def staged(cls, layout: StepLayout, buffers: StepBuffers) -> "PagedContext":
        """``layout``'s context, staged through ``buffers``."""
        stage = buffers.stage
        cu = np.zeros(layout.num_seqs + 1, dtype=np.int32)
        np.cumsum(layout.query_lens, out=cu[1:])
        return cls(layout, stage("positions", layout.positions), stage("slot_mapping", layout.slot_mapping),
                   layout.num_tokens, layout.is_decode, first_rows=stage("first_rows", layout.first_rows),
                   block_tables=stage("block_tables", layout.block_table),
                   kv_lens=stage("kv_lens", layout.kv_lens.astype(np.int32)), cu_q=stage("cu_q", cu),
                   block_size=layout.block_size)


@dataclass
class CPContext(AttnContext):
    """A context-parallel (CP) prefill step of one rank: its tokens are its pieces of one prompt
    (positions, cos/sin as any step's; ``slot_mapping``: its own tokens' cache slots, written by the
    owner only), and ``ring`` exchanges every layer's KV with the other ranks
    (``afdserve.backends.pytorch.cp_half``). The owner (rank 0) writes every rank's KV into its
    cache: each other rank's tokens at ``rank_slots[rank]`` (int64, in that rank's piece order, as
    its positions come through the ring); a helper rank writes nothing. ``attention``: the partial
    attentions for the step's device, chosen once (``RingAttention.on(device)``; None: the
    device-agnostic ones). ``pieces``: every rank's position ranges (host ints), so that only the
    blocks of queries and keys that see each other are computed (None: all, masked); ``rank``:
    this one's."""

    ring: Ring | None = None
    owner: bool = False
    rank_slots: dict[int, torch.Tensor] = field(default_factory=dict)
    attention: RingAttention | None = None
    pieces: tuple | None = None
    rank: int = 0
    keep: bool = False  # every rank writes its own KV only, compact at ``slot_mapping`` (sharded)

    def pieces_of(self, rank: int):
        """Rank ``rank``'s position ranges, or None where the context has none."""
        return None if self.pieces is None else self.pieces[rank]


@dataclass
class ShardedContext(AttnContext):
    """A decode step of one sequence whose prompt KV stays sharded over context-parallel ranks
    (``afdserve.engine.cp``; ``afdserve.backends.pytorch.cp_decode``): its new token is written at
    ``slot_mapping``; this rank's keys are at ``own_slots`` (int64, the new one last) with their
    positions ``own_positions``; ``peers`` attend over the other shards. ``attention``: the partial
    attentions for the step's device (``RingAttention.on(device)``; None: the device-agnostic ones)."""

    peers: ShardPeers | None = None
    own_slots: torch.Tensor | None = None
    own_positions: torch.Tensor | None = None
    attention: RingAttention | None = None
