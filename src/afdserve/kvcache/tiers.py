"""The lower tiers of the prefix cache: host memory, then disk, and the choice between restoring a
block from them and recomputing it.

A block evicted from the device pool is copied to host memory (bounded, least recently used out);
a block pushed out of host memory is written to disk (bounded likewise). Both tiers are inclusive:
a block restored to the device stays where it was, so evicting it again costs nothing. Whether a
lower-tier hit is restored is decided from running averages of measured rates (restore bytes/s of
each tier, prefill tokens/s of this engine); until a rate is measured, hits are restored, and now
and then a block judged not worth it is restored anyway so that the rate follows changes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

import torch

from afdserve.kvcache.disk import Block, DiskTier
from afdserve.kvcache.prefix import PrefixCacheConfig

HOST, DISK = "host", "disk"


class Rate:
    """A running average of amount per second (exponentially weighted over measurements)."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.value = 0.0  # 0: nothing measured yet

    def observe(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        r = amount / seconds
        self.value = r if self.value == 0.0 else (1 - self.weight) * self.value + self.weight * r


class HostTier:
    def __init__(self, limit_bytes: int):
        self.limit = int(limit_bytes)
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.bytes = 0
        self.evictions = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.blocks

    def get(self, key: bytes) -> Block | None:
        kv = self.blocks.get(key)
        if kv is not None:
            self.blocks.move_to_end(key)
        return kv

    def put(self, key: bytes, parts: Block) -> list[tuple[bytes, Block]]:
        """Keeps a copy; returns the blocks pushed out to stay within the bound."""
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return []
        pin = torch.cuda.is_available() and parts[0].is_cuda
        copy = tuple(p.detach().to("cpu", copy=True) for p in parts)
        self.blocks[key] = tuple(p.pin_memory() for p in copy) if pin else copy
        self.bytes += _nbytes(copy)
        out = []
        while self.bytes > self.limit and self.blocks:
            old, got = self.blocks.popitem(last=False)
            self.bytes -= _nbytes(got)
            self.evictions += 1
            out.append((old, got))
        return out


def _nbytes(parts: Block) -> int:
    return sum(p.numel() * p.element_size() for p in parts)


class Tiers:
    REPROBE = 64  # one in this many blocks judged not worth restoring is restored, to measure again

    def __init__(self, cfg: PrefixCacheConfig, block_shapes: tuple[tuple[int, ...], ...],
                 dtypes: tuple[torch.dtype, ...], block_size: int):
        self.block_size = block_size
        self.host = HostTier(cfg.host_bytes) if cfg.host_bytes > 0 else None
        self.disk = (DiskTier(cfg.disk_dir, cfg.salt, cfg.disk_bytes, block_shapes, dtypes)
                     if cfg.disk_dir and cfg.disk_bytes > 0 else None)
        self.rates = {HOST: Rate(), DISK: Rate()}
        self.prefill = Rate()
        self._skips = {HOST: 0, DISK: 0}
        self.restored = 0
        self.recomputed = 0

    @property
    def enabled(self) -> bool:
        return self.host is not None or self.disk is not None

    def spill(self, key: bytes, read: Callable[[], Block]) -> None:
        """A block leaves the device pool; ``read`` gives its tensors (copied only if needed)."""
        if self.host is not None:
            if key in self.host:
                self.host.get(key)
                return
            for old, parts in self.host.put(key, read()):
                if self.disk is not None:
                    self.disk.put(old, parts)
        elif self.disk is not None and key not in self.disk:
            self.disk.put(key, read())

    def where(self, key: bytes) -> str | None:
        if self.host is not None and key in self.host:
            return HOST
        if self.disk is not None and key in self.disk:
            return DISK
        return None

    def worth_restoring(self, tier: str, block_bytes: int) -> bool:
        """Restoring one block from ``tier`` is expected to be faster than recomputing its tokens."""
        restore, prefill = self.rates[tier].value, self.prefill.value
        if restore == 0.0 or prefill == 0.0:
            return True  # not measured yet: restore (which measures it)
        if block_bytes / restore < self.block_size / prefill:
            return True
        self._skips[tier] += 1  # now and then restore anyway, so the rate follows changes
        return self._skips[tier] % self.REPROBE == 0

    def restore(self, key: bytes, tier: str,
                write: Callable[[Block], None]) -> bool:
        """Reads a block from ``tier`` and hands it to ``write`` (into a device block), timing the
        whole restore; False when the block is gone or invalid."""
        t0 = time.perf_counter()
        got = (self.host.get(key) if tier == HOST and self.host is not None else
               self.disk.get(key) if tier == DISK and self.disk is not None else None)
        if got is None:
            return False
        write(got)
        self.rates[tier].observe(_nbytes(got), time.perf_counter() - t0)
        self.restored += 1
        return True

    def persist(self, key: bytes, read: Callable[[], Block]) -> None:
        """Writes a block to disk (if there is a disk tier; a block there already becomes most recent)."""
        if self.disk is not None:
            self.disk.put(key, read())

