"""Prefix-cache keys and counters.

A full KV block is keyed by a hash chain: the key of block ``i`` covers every token of blocks
``0..i`` and the salt, the identity of everything else that changes the block's keys and values
(the model and its revision, the dtype, the KV dtype, the block size). Keys are SHA-256 digests,
so they are the same in every process and after a restart (no Python ``hash()``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KEY_BYTES = 32


def block_hashes(token_ids: list[int], block_size: int, salt: bytes,
                 parent: int | bytes | None = None) -> list[bytes]:
    """Keys of the full blocks of ``token_ids`` (a trailing partial block gets none). ``parent``:
    the key of the block before ``token_ids[0]`` (None: the tokens start the sequence)."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    prev = salt if parent is None else (parent if isinstance(parent, bytes) else
                                        int(parent).to_bytes(KEY_BYTES, "little", signed=False))
    arr = np.asarray(token_ids, dtype=np.int64)
    out: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        prev = hashlib.sha256(prev + arr[i * block_size:(i + 1) * block_size].tobytes()).digest()
        out.append(prev)
    return out


def model_salt(model_dir: str | Path, dtype: str, kv_dtype: str, block_size: int) -> bytes:
    """The identity of a model's KV contents: its ``config.json``, the names, sizes and modification
    times of its weight files (a changed revision changes them), the dtype, KV dtype and block size."""
    root = Path(model_dir)
    h = hashlib.sha256(b"afdserve-kv-v1")
    cfg = root / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for f in sorted(root.iterdir()) if root.is_dir() else ():
        if f.suffix in (".safetensors", ".bin", ".pt", ".pth") and f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(f"dtype={dtype};kv_dtype={kv_dtype};block_size={block_size}".encode())
    return h.digest()


@dataclass(frozen=True)
class PrefixCacheConfig:
    """What a block manager caches beyond its device blocks. ``host_bytes``/``disk_bytes`` bound
    the tiers (0: no such tier); ``disk_dir`` is shared by every engine of the same salt."""

    salt: bytes
    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters since start (``queries``/``hits`` in tokens and requests) and the current state of
    each tier. Device usage counts blocks; host and disk usage bytes."""

    enabled: bool = False
    query_requests: int = 0  # admissions that looked the cache up (a preempted request counts again)
    hit_requests: int = 0  # of those, the ones with at least one cached block
    query_tokens: int = 0  # prompt (and re-admitted output) tokens looked up
    hit_tokens: int = 0  # tokens not recomputed (all tiers)
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0  # restored from host memory
    disk_hit_tokens: int = 0  # restored from disk
    restored_blocks: int = 0  # blocks copied back from host or disk
    recomputed_blocks: int = 0  # blocks found in host or disk but recomputed (cheaper, by the measured rates)
    invalid_disk_files: int = 0  # disk files ignored: truncated, corrupt or of another model/dtype
    device_evictions: int = 0
    host_evictions: int = 0
    disk_evictions: int = 0
    device_cached_blocks: int = 0  # blocks holding a cached key (referenced or not)
    device_used_blocks: int = 0  # blocks referenced by running sequences
    device_total_blocks: int = 0
    host_bytes: int = 0
    host_bytes_limit: int = 0
    disk_bytes: int = 0
    disk_bytes_limit: int = 0
    host_restore_bytes_per_s: float = 0.0  # running averages (0: not measured yet)
    disk_restore_bytes_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
