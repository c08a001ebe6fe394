"""Allocation of KV-cache blocks to sequences, with automatic prefix caching.

Each sequence owns a block table. With prefix caching (a ``PrefixCacheConfig``), a full block whose
keys and values are computed is registered under its hash-chain key (``afdserve.kvcache.prefix``);
a later sequence whose tokens start with the same blocks takes them by reference instead of
recomputing them. A block nobody references stays cached in the free pool, least recently released
first out: a new allocation takes uncached free blocks first, then evicts the least recently used
cached one (spilling it to the host/disk tiers, ``afdserve.kvcache.tiers``, when there are any).
As in nano-vllm's and vLLM's block managers, keys are chained so a block matches only after the
whole prefix before it matched, and only full blocks are shared (a shared block is never written).

A sequence whose oldest tokens no layer attends to any more (sliding windows) gives their blocks
back early (``release_before``): its table then holds the live blocks only (after
``num_released`` given back), and the slots of the released positions read as -1.

Besides each sequence's list, the manager keeps every live sequence's blocks as a row of one
persistent int32 array (``BlockRows``), written only where a table changes (blocks taken, given
back, freed), so that a step's block tables are one gather of its sequences' rows (``batch_table``),
not a table rebuilt from lists on every step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from afdserve.kvcache.cache import KVCache
from afdserve.kvcache.prefix import PrefixCacheConfig, PrefixCacheStats
from afdserve.kvcache.tiers import DISK, HOST, Tiers


def block_slots(tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache slot of every position of block tables [..., B] (a -1 block gives -1 slots):
    [..., B * block_size] int64."""
    t = tables.to(torch.int64)[..., None]
    out = t * block_size + torch.arange(block_size, device=t.device)
    # masked_fill_, not torch.where: where broadcasting the mask is much slower on the CPU
    return out.masked_fill_((t < 0).expand_as(out), -1).flatten(-2)


class BlockRows:
    """Block tables as rows of one int32 array that persists across steps: a row per live sequence
    (position j of a row holds the sequence's block j, -1 where given back or not taken), grown by
    doubling when rows or columns run out; ``count[row]`` is the row's length in blocks."""

    def __init__(self, rows: int = 64, cols: int = 16):
        if rows < 1 or cols < 2:
            raise ValueError("BlockRows needs at least 1 row and 2 columns")
        self.array = np.full((rows, cols), -1, dtype=np.int32)
        self.count = np.zeros(rows, dtype=np.int64)
        self.row_of: dict[int, int] = {}
        self._free_rows = list(range(rows - 1, -1, -1))  # popped from the end: row 0 first

    def row(self, seq_id: int) -> int:
        """The row of ``seq_id`` (taking a free one, or growing the array, the first time)."""
        r = self.row_of.get(seq_id)
        if r is None:
            if not self._free_rows:
                n = self.array.shape[0]
                self.array = np.concatenate([self.array, np.full_like(self.array, -1)])
                self.count = np.concatenate([self.count, np.zeros(n, dtype=np.int64)])
                self._free_rows = list(range(2 * n - 1, n - 1, -1))
            r = self.row_of[seq_id] = self._free_rows.pop()
        return r

    def write(self, seq_id: int, start: int, blocks: list[int]) -> None:
        """Blocks ``blocks`` at positions ``[start, start + len(blocks))`` of the sequence's row."""
        r, end = self.row(seq_id), start + len(blocks)
        if end > self.array.shape[1]:
            cols = max(end, 2 * self.array.shape[1])
            wider = np.full((self.array.shape[0], cols), -1, dtype=np.int32)
            wider[:, : self.array.shape[1]] = self.array
            self.array = wider
        self.array[r, start:end] = blocks
        self.count[r] = max(int(self.count[r]), end)

    def clear(self, seq_id: int, start: int, end: int) -> None:
        """Positions ``[start, end)`` of the sequence's row read -1 (blocks given back)."""
        r = self.row_of.get(seq_id)
        if r is not None:
            self.array[r, start:end] = -1

    def drop(self, seq_id: int) -> None:
        r = self.row_of.pop(seq_id, None)
        if r is not None:
            self.array[r, : self.count[r]] = -1
            self.count[r] = 0
            self._free_rows.append(r)

    def gather(self, seq_ids: list[int]) -> np.ndarray:
        """[len(seq_ids), max(2, longest row)] int32: the rows of ``seq_ids`` (a copy; past a row's
        length -1). At least 2 columns: a width of 1 would make torch.compile specialize."""
        rows = np.fromiter((self.row_of.get(s, -1) for s in seq_ids), dtype=np.int64, count=len(seq_ids))
        if (rows < 0).any():
            missing = [s for s, r in zip(seq_ids, rows) if r < 0]
            raise KeyError(f"sequences {missing} hold no blocks")
        width = max(2, int(self.count[rows].max()) if len(rows) else 0)  # <= the columns (at least 2)
        return self.array[rows, :width]


@dataclass
class PrefixHit:
    """The cached blocks a sequence can start with: device blocks, then blocks worth restoring from
    host memory or disk (in chain order)."""

    device: list[int] = field(default_factory=list)
    lower: list[tuple[bytes, str]] = field(default_factory=list)  # (key, tier)
    unreferenced: int = 0  # device blocks in the free pool (taking them uses free blocks)
    recompute: int = 0  # lower-tier blocks after these, not worth restoring

    @property
    def num_blocks(self) -> int:
        return len(self.device) + len(self.lower)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix: PrefixCacheConfig | None = None,
                 kv: KVCache | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # next taken first
        self.refs = [0] * num_blocks
        self.key_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # key -> device block
        self.tables: dict[int, list[int]] = {}  # per sequence: its live blocks (after those released)
        self._committed: dict[int, int] = {}  # per sequence: blocks of its table already registered
        self._released: dict[int, int] = {}  # per sequence: leading blocks given back early
        self.rows = BlockRows()  # the same tables as rows of one persistent array (batch_table)
        self.prefix, self.kv = prefix, kv
        self.salt = prefix.salt if prefix is not None else None
        self.tiers: Tiers | None = None
        if prefix is not None and kv is not None and (prefix.host_bytes > 0 or (prefix.disk_dir and prefix.disk_bytes > 0)):
            self.tiers = Tiers(prefix, kv.block_shapes, kv.block_dtypes, block_size)
        self._counts = dict.fromkeys(("query_requests", "hit_requests", "query_tokens", "hit_tokens",
                                      "device_hit_tokens", "host_hit_tokens", "disk_hit_tokens", "device_evictions"), 0)

    @property
    def enabled(self) -> bool:
        return self.prefix is not None

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

    def held(self, seq_ids: Iterable[int]) -> list[int]:
        """The blocks each of ``seq_ids`` holds, given back ones included (``blocks_needed``'s count):
        a sequence holds room for ``held * block_size`` tokens."""
        tables, released = self.tables, self._released
        if not released:
            return [len(tables.get(s, ())) for s in seq_ids]
        return [len(tables.get(s, ())) + released.get(s, 0) for s in seq_ids]

    def can_hold(self, seq_id: int, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= len(self._free)

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise MemoryError(f"KV cache: need {need} blocks, {len(self._free)} free")
        table = self.tables.setdefault(seq_id, [])
        start = self._released.get(seq_id, 0) + len(table)
        new = [self._take() for _ in range(need)]
        table.extend(new)
        self.rows.write(seq_id, start, new)

    def free(self, seq_id: int) -> None:
        """Releases a sequence's blocks; its cached blocks stay cached until evicted."""
        self._committed.pop(seq_id, None)
        self._released.pop(seq_id, None)
        self.rows.drop(seq_id)
        self._unref(reversed(self.tables.pop(seq_id, ())))  # its last blocks are evicted first

    def num_released(self, seq_id: int) -> int:
        return self._released.get(seq_id, 0)

    def release_before(self, seq_id: int, position: int) -> int:
        """Gives back the blocks of ``seq_id`` whose tokens all lie before ``position`` (no layer
        will read them again; a cached one stays cached); their slots become -1. Returns how many
        blocks were given back."""
        table = self.tables.get(seq_id)
        if not table:
            return 0
        done = self._released.get(seq_id, 0)
        n = min(max(0, position // self.block_size - done), len(table))
        if n == 0:
            return 0
        self._unref(table[:n])
        del table[:n]
        self._released[seq_id] = done + n
        self.rows.clear(seq_id, done, done + n)
        return n

    def _unref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free[b] = None
                if self.key_of[b] is None:
                    self._free.move_to_end(b, last=False)  # uncached blocks are taken before cached ones

    def block_table(self, seq_id: int) -> list[int]:
        """The block of each of the sequence's ``block_size`` positions so far (-1: given back)."""
        table = self.tables.get(seq_id, [])
        released = self._released.get(seq_id, 0)
        return [-1] * released + table if released else list(table)

    def batch_table(self, seq_ids: list[int]) -> np.ndarray:
        """The block tables of ``seq_ids`` as [S, max(2, longest)] int32 rows (-1: given back or past
        a sequence's blocks): ``block_table`` of each, padded, gathered from the persistent rows."""
        return self.rows.gather(seq_ids)

    def slots(self, seq_id: int, num_tokens: int) -> torch.Tensor:
        """Cache slots of token positions [0, num_tokens) of a sequence (-1: given back)."""
        slots = block_slots(torch.tensor(self.block_table(seq_id), dtype=torch.int64), self.block_size)
        if num_tokens > slots.numel():
            raise ValueError(f"sequence {seq_id} holds {slots.numel()} slots, {num_tokens} asked for")
        return slots[:num_tokens]

    # ---- prefix caching ---------------------------------------------------------------------
    def lookup(self, keys: list[bytes], max_blocks: int) -> PrefixHit:
        """The longest cached prefix of ``keys[:max_blocks]`` (no side effects)."""
        hit = PrefixHit()
        if self.prefix is None:
            return hit
        keys = keys[:max(0, max_blocks)]
        for key in keys:
            b = self.cached.get(key)
            if b is None:
                break
            hit.device.append(b)
            hit.unreferenced += self.refs[b] == 0
        if self.tiers is None:
            return hit
        block_bytes = self.kv.block_bytes if self.kv is not None else 0
        for key in keys[len(hit.device):]:
            tier = self.tiers.where(key)
            if tier is None:
                break
            if hit.recompute or not self.tiers.worth_restoring(tier, block_bytes):
                hit.recompute += 1
            else:
                hit.lower.append((key, tier))
        return hit

    def can_admit(self, hit: PrefixHit, num_tokens: int) -> bool:
        """Whether a new sequence starting with ``hit`` fits ``num_tokens`` tokens now."""
        need = -(-num_tokens // self.block_size) - len(hit.device) + hit.unreferenced
        return need <= len(self._free)

    def acquire(self, seq_id: int, hit: PrefixHit, num_tokens: int) -> int:
        """Gives a new sequence of ``num_tokens`` tokens the blocks of ``hit`` (restoring lower-tier
        ones into new device blocks); returns the number of its tokens already computed."""
        if self.tables.get(seq_id):
            raise ValueError(f"sequence {seq_id} already holds blocks")
        table = self.tables.setdefault(seq_id, [])
        for b in hit.device:
            if self.refs[b] == 0:
                del self._free[b]
            self.refs[b] += 1
            table.append(b)
        restored = {HOST: 0, DISK: 0}
        for key, _ in hit.lower:
            tier = self.tiers.where(key) if self.tiers is not None else None
            if tier is None or key in self.cached:
                break
            b = self._take()
            if not self.tiers.restore(key, tier, lambda parts, b=b: self.kv.write_block(b, parts)):
                self.refs[b] = 0
                self._free[b] = None
                self._free.move_to_end(b, last=False)
                break
            self.cached[key], self.key_of[b] = b, key
            table.append(b)
            restored[tier] += 1
        if self.tiers is not None:
            self.tiers.recomputed += hit.recompute + len(hit.lower) - sum(restored.values())
        self._committed[seq_id] = len(table)
        self.rows.write(seq_id, 0, table)
        bs, c = self.block_size, self._counts
        if self.prefix is not None:
            c["query_requests"] += 1
            c["hit_requests"] += bool(table)
            c["query_tokens"] += num_tokens
            c["hit_tokens"] += len(table) * bs
            c["device_hit_tokens"] += len(hit.device) * bs
            c["host_hit_tokens"] += restored[HOST] * bs
            c["disk_hit_tokens"] += restored[DISK] * bs
        return len(table) * bs

    def commit(self, seq_id: int, keys: list[bytes], num_computed: int) -> None:
        """Registers the sequence's blocks that are full and computed (``keys``: its chain keys)."""
        if self.prefix is None:
            return
        table = self.tables.get(seq_id, [])
        off = self._released.get(seq_id, 0)  # table[j - off] is the sequence's block j
        start = max(self._committed.get(seq_id, 0), off)
        full = min(num_computed // self.block_size, len(keys), off + len(table))
        for j in range(start, full):
            b, key = table[j - off], keys[j]
            if self.key_of[b] is None and key not in self.cached:  # else an equal block is cached already
                self.cached[key], self.key_of[b] = b, key
        self._committed[seq_id] = max(start, full)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step that computed ``tokens`` prompt tokens took ``seconds`` (the recompute rate)."""
        if self.tiers is not None:
            self.tiers.prefill.observe(tokens, seconds)

    def persist(self) -> None:
        """Writes every cached block (device and host) to the disk tier, so it survives a restart."""
        t = self.tiers
        if t is None or t.disk is None or self.kv is None:
            return
        # least recently used first: host blocks, unreferenced device blocks, referenced ones; only
        # the most recent that fit the bound are written
        items = [(key, lambda kv=kv: kv) for key, kv in (t.host.blocks.items() if t.host is not None else ())]
        free = [b for b in self._free if self.key_of[b] is not None]
        used = [b for b in self.cached.values() if self.refs[b] > 0]
        items += [(self.key_of[b], lambda b=b: self.kv.read_block(b)) for b in free + used]
        fit = t.disk.limit // max(1, self.kv.block_bytes)
        for key, read in items[max(0, len(items) - fit):]:
            t.persist(key, read)

    def stats(self) -> PrefixCacheStats:
        t = self.tiers
        host = t.host if t is not None else None
        disk = t.disk if t is not None else None
        return PrefixCacheStats(
            enabled=self.prefix is not None, **self._counts,
            restored_blocks=t.restored if t else 0, recomputed_blocks=t.recomputed if t else 0,
            invalid_disk_files=disk.invalid if disk else 0,
            host_evictions=host.evictions if host else 0, disk_evictions=disk.evictions if disk else 0,
            device_cached_blocks=len(self.cached), device_used_blocks=self.num_blocks - len(self._free),
            device_total_blocks=self.num_blocks, host_bytes=host.bytes if host else 0,
            host_bytes_limit=host.limit if host else 0, disk_bytes=disk.bytes if disk else 0,
            disk_bytes_limit=disk.limit if disk else 0,
            host_restore_bytes_per_s=t.rates[HOST].value if t else 0.0,
            disk_restore_bytes_per_s=t.rates[DISK].value if t else 0.0,
            prefill_tokens_per_s=t.prefill.value if t else 0.0)

    # ---- internals ----------------------------------------------------------------------------
    def _take(self) -> int:
        b, _ = self._free.popitem(last=False)
        key = self.key_of[b]
        if key is not None:  # evict: the least recently released cached block
            del self.cached[key]
            self.key_of[b] = None
            self._counts["device_evictions"] += 1
            if self.tiers is not None and self.kv is not None:
                self.tiers.spill(key, lambda: self.kv.read_block(b))
        self.refs[b] = 1
        return b
