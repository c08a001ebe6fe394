"""Context-parallel prefill on the engine's side: a prompt split over several attention workers
(``CPShard``: the zigzag split of ``afdserve.kvcache.cp_split``), each computing its pieces of the
prompt in one step of its own while the attention of every layer passes the pieces' KV around the
ranks (``afdserve.runtime.cp``).

Where the prompt's KV goes (``CPShard.keep``, decided by the front end from its size):

* gathered: the owner (rank 0, which holds the prompt's last piece) allocates the whole prompt's
  blocks first and writes every rank's KV into them as it comes: after the step it holds the whole
  prompt and the request decodes as any other. The other ranks (helpers) keep nothing and emit nothing.
* sharded (``keep``): every rank keeps its own pieces' KV, *compact* (its i-th position in slot i of
  its blocks: ``compact_slots``). The owner then decodes the request in steps of its own
  (``ShardedDecode``): every layer sends its query to the helpers, which attend over their shards
  and send back (output, log-sum-exp) (``afdserve.runtime.cp``); the owner attends over its own
  pieces and the tokens it decoded since, and merges. A helper holds its shard until the request
  is aborted there (the front end does so when it ends).

``cp_layout`` lays a CP step out for the runner (``Engine`` builds its inputs): the rank's pieces are
the rows of a ``StepLayout`` (one per piece, all reading the sequence's block table), its tokens the
step's input ids. A request asking for prompt logprobs has every rank's final hidden states sent to
the owner, after its own in rank order: the *extended* rows the owner's LM head reads
(``extended_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    keep: bool = False  # every rank keeps its pieces' KV (sharded decode); else the owner gathers all

    @property
    def owner(self) -> bool:
        return self.rank == 0

    @property
    def total(self) -> int:
        """The positions the pieces cover (the tokens prefilled)."""
        return sum(b - a for p in self.pieces for a, b in p)

    @property
    def held(self) -> int:
        """The positions this rank computes (and keeps, sharded)."""
        return sum(b - a for a, b in self.pieces[self.rank])

    def held_after(self, pos: int) -> int:
        """The tokens the owner of a sharded sequence holds once position ``pos`` is computed (its
        pieces, then every token after the prompt)."""
        return pos + 1 - (self.total - self.held)

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


@dataclass(frozen=True)
class ShardedDecode:
    """What a runner needs of a decode step of a sharded sequence beyond its layout
    (``ModelInput.sharded``): the owner's keys are those at ``slots`` (int64: its pieces, then the
    tokens it decoded, the step's new one last), at ``positions``; the helpers (``shard.ranks[1:]``)
    hold the rest."""

    shard: CPShard
    slots: np.ndarray
    positions: np.ndarray


def sharded_layout(shard: CPShard, table: list[int], pos: int, block_size: int) -> tuple[StepLayout, ShardedDecode]:
    """The owner's decode step of a sharded sequence whose new token is at position ``pos``: its
    layout (one row, ``slot_mapping`` the owner's next compact slot) and what the runner needs
    beyond it."""
    slots = compact_slots(table, shard.held_after(pos), block_size)
    positions = np.concatenate([shard.positions(), np.arange(shard.total, pos + 1, dtype=np.int64)])
    wide = np.full((1, max(2, len(table), pos // block_size + 1)), -1, dtype=np.int32)
    wide[0, : len(table)] = table
    layout = replace(StepLayout.of([1], [pos + 1], wide, block_size), slot_mapping=slots[-1:])
    return layout, ShardedDecode(shard, slots, positions)


def compact_slots(table: list[int], n: int, block_size: int) -> np.ndarray:
    """The cache slots of a sequence's first ``n`` tokens kept compact in its blocks ``table``."""
    i = np.arange(n, dtype=np.int64)
    return np.asarray(table, dtype=np.int64)[i // block_size] * block_size + i % block_size


def cp_layout(shard: CPShard, table: list[int], block_size: int) -> tuple[StepLayout, dict[int, np.ndarray]]:
    """The CP step's layout (a row per piece of this rank; the owner's rows read ``table``, the
    sequence's blocks, a helper's none; with ``keep``, every rank's its own, compact) and, for the
    owner gathering the prompt, every other rank's slots."""
    own = shard.pieces[shard.rank]
    q = [b - a for a, b in own]
    kv = [b for _, b in own]
    row = np.asarray(table if shard.owner or shard.keep else [], dtype=np.int32)
    width = max(2, row.shape[0], -(-max(kv) // block_size))  # a helper's: no blocks (-1), as wide as its positions
    tables = np.full((len(own), width), -1, dtype=np.int32)
    tables[:, : row.shape[0]] = row
    layout = StepLayout.of(q, kv, tables, block_size)
    slots = {}
    if shard.keep:  # pieces start on block boundaries: compact, every block is entered at its first slot
        return replace(layout, slot_mapping=compact_slots(table, layout.num_tokens, block_size)), slots
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
