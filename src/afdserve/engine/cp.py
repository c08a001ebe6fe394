"""Context-parallel prefill on the engine's side: a prompt split over several attention workers
(``CPShard``: the zigzag split of ``afdserve.kvcache.cp_split``), each computing its pieces of the
prompt in one step of its own while the attention of every layer passes the pieces' KV around the
ranks (``afdserve.runtime.cp``).

The owner (rank 0, which holds the prompt's last piece) allocates the whole prompt's blocks first
and writes every rank's KV into them as it comes: after the step it holds the whole prompt and the
request decodes as any other. The other ranks (helpers) keep nothing and emit nothing.

``cp_layout`` lays a CP step out for the runner (``Engine`` builds its inputs): the rank's pieces are
the rows of a ``StepLayout`` (one per piece, all reading the sequence's block table), its tokens the
step's input ids. A request asking for prompt logprobs has every rank's final hidden states sent to
the owner, after its own in rank order: the *extended* rows the owner's LM head reads
(``extended_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from afdserve.backends.step import StepLayout

Pieces = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class CPShard:
    """One worker's part of a context-parallel prefill: ``pieces[rank]`` of a prompt split over
    ``ranks`` (attention worker indices; ``ranks[0]`` owns the request: it holds every block after
    the prefill and decodes). ``handle``: the front end's CP prefill number, increasing; every rank
    runs its CP prefills in this order."""

    handle: int
    rank: int
    ranks: tuple[int, ...]
    pieces: tuple[Pieces, ...]  # every rank's [start, end) position ranges

    @property
    def owner(self) -> bool:
        return self.rank == 0

    @property
    def size(self) -> int:
        return len(self.ranks)

    def positions(self, rank: int | None = None) -> np.ndarray:
        """The positions ``rank`` (default: this one) computes, in piece order (int64)."""
        ps = self.pieces[self.rank if rank is None else rank]
        if not ps:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in ps])

    def check(self, prompt_len: int) -> None:
        """ValueError unless the pieces cover the prompt exactly once and the owner holds its last token."""
        got = np.sort(np.concatenate([self.positions(r) for r in range(self.size)]))
        if got.shape[0] != prompt_len or not np.array_equal(got, np.arange(prompt_len)):
            raise ValueError(f"CP shard {self.handle}: the ranks' pieces do not cover the prompt's {prompt_len} "
                             "positions exactly once")
        if not 0 <= self.rank < self.size or prompt_len - 1 not in self.positions(0):
            raise ValueError(f"CP shard {self.handle}: rank {self.rank} of {self.size}, or the owner (rank 0) "
                             "does not hold the prompt's last token")


@dataclass(frozen=True)
class CPStep:
    """What a runner needs of a CP step beyond its layout (``ModelInput.cp``)."""

    shard: CPShard
    # owner: every other rank's cache slots, for its positions in piece order (int64), by rank
    rank_slots: dict[int, np.ndarray]
    hidden: bool  # the ranks' final hidden states go to the owner (prompt logprobs)


def cp_layout(shard: CPShard, table: list[int], block_size: int) -> tuple[StepLayout, dict[int, np.ndarray]]:
    """The CP step's layout (a row per piece of this rank; the owner's rows read ``table``, the
    sequence's blocks, a helper's none) and, for the owner, every other rank's slots."""
    own = shard.pieces[shard.rank]
    q = [b - a for a, b in own]
    kv = [b for _, b in own]
    row = np.asarray(table if shard.owner else [], dtype=np.int32)
    width = max(2, row.shape[0], -(-max(kv) // block_size))  # a helper's: no blocks (-1), as wide as its positions
    tables = np.full((len(own), width), -1, dtype=np.int32)
    tables[:, : row.shape[0]] = row
    layout = StepLayout.of(q, kv, tables, block_size)
    slots = {}
    if shard.owner:
        blocks = np.asarray(table, dtype=np.int64)
        for r in range(1, shard.size):
            pos = shard.positions(r)
            slots[r] = blocks[pos // block_size] * block_size + pos % block_size
    return layout, slots


def extended_rows(shard: CPShard) -> np.ndarray:
    """The position of each row the owner's LM head reads when the helpers send their final hidden
    states: its own rows, then every other rank's in rank order."""
    return np.concatenate([shard.positions(r) for r in range(shard.size)])
