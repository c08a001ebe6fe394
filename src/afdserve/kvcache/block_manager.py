"""Allocation of KV-cache blocks to sequences."""

from __future__ import annotations

from collections import deque

import torch


class BlockManager:
    """A free list of fixed-size blocks; each sequence owns a block table.

    A sequence whose oldest tokens no layer attends to any more (sliding windows) gives their
    blocks back early (``release_before``): its table then holds the live blocks only (after
    ``num_released`` given back), and the slots of the released positions read as -1.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}
        self._slots: dict[int, torch.Tensor] = {}  # per sequence: slots of its positions so far
        self._released: dict[int, int] = {}  # per sequence: leading blocks given back early

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Blocks still to allocate so that ``seq_id`` can hold ``num_tokens`` tokens."""
        have = len(self.tables.get(seq_id, ())) + self._released.get(seq_id, 0)
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_hold(self, seq_id: int, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= len(self._free)

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise MemoryError(f"KV cache: need {need} blocks, {len(self._free)} free")
        table = self.tables.setdefault(seq_id, [])
        new = [self._free.popleft() for _ in range(need)]
        table.extend(new)
        if new:  # slots of the new blocks, appended to the sequence's slot list
            add = (torch.tensor(new, dtype=torch.int64)[:, None] * self.block_size
                   + torch.arange(self.block_size)).reshape(-1)
            have = self._slots.get(seq_id)
            self._slots[seq_id] = add if have is None else torch.cat([have, add])

    def free(self, seq_id: int) -> None:
        self._free.extend(self.tables.pop(seq_id, ()))
        self._slots.pop(seq_id, None)
        self._released.pop(seq_id, None)

    def num_released(self, seq_id: int) -> int:
        return self._released.get(seq_id, 0)

    def release_before(self, seq_id: int, position: int) -> int:
        """Gives back the blocks of ``seq_id`` whose tokens all lie before ``position`` (no layer
        will read them again); their slots become -1. Returns how many blocks were freed."""
        table = self.tables.get(seq_id)
        if not table:
            return 0
        done = self._released.get(seq_id, 0)
        n = min(max(0, position // self.block_size - done), len(table))
        if n == 0:
            return 0
        self._free.extend(table[:n])
        del table[:n]
        self._released[seq_id] = done + n
        self._slots[seq_id][done * self.block_size : (done + n) * self.block_size] = -1
        return n

    def slots(self, seq_id: int, num_tokens: int) -> torch.Tensor:
        """Cache slots of token positions [0, num_tokens) of a sequence (a view: the slots of a
        sequence's blocks are computed once, when the blocks are reserved)."""
        have = self._slots[seq_id]
        if num_tokens > have.shape[0]:
            raise ValueError(f"sequence {seq_id} holds {have.shape[0]} slots, {num_tokens} asked for")
        return have[:num_tokens]
