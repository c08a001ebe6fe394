"""The disk tier of the prefix cache: one safetensors file per block, kept across restarts.

Files live in ``<dir>/<salt>/``, one per key, written atomically (a temporary file, then a rename).
Each holds the key, the salt, the shapes, the dtype and a SHA-256 of the keys and values in its
metadata; a file is served only when all of them match (a truncated, corrupt or foreign file is
dropped, never served). Least recently used files are deleted beyond the size bound.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from afdserve.comm.shm import pid_alive

FORMAT = "afdserve-kv-2"
SUFFIX = ".kv"


Block = tuple[torch.Tensor, ...]  # one block of every cache tensor: (keys, values), or (latent,); fp8: + scales


def _digest(parts: Block) -> str:
    h = hashlib.sha256()
    for t in parts:
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _metadata(data: bytes) -> dict[str, str]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]).get("__metadata__", {})


def tier_dir(root: str | Path, salt: bytes) -> Path:
    """The folder of the blocks of one salt (one model, dtype and block size) under ``root``."""
    return Path(root).expanduser() / salt.hex()[:32]


class DiskTier:
    def __init__(self, root: str | Path, salt: bytes, limit_bytes: int, shapes: tuple[tuple[int, ...], ...],
                 dtypes: tuple[torch.dtype, ...]):
        self.dir = tier_dir(root, salt)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.salt, self.limit, self.dtypes = salt, int(limit_bytes), tuple(dtypes)
        if len(self.dtypes) != len(shapes):
            raise ValueError(f"disk tier: {len(shapes)} block shapes but {len(self.dtypes)} dtypes")
        self.shapes = tuple(tuple(s) for s in shapes)
        self.files: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recently used first
        self.bytes = 0
        self.evictions = 0
        self.invalid = 0
        found = []
        for f in self.dir.glob(".*.tmp"):  # a write cut short (its process is gone)
            pid = f.name.rsplit(".", 2)[-2]
            if pid.isdigit() and not pid_alive(int(pid)):
                f.unlink(missing_ok=True)
        for f in self.dir.glob("*" + SUFFIX):
            try:
                st = f.stat()
                found.append((st.st_mtime_ns, bytes.fromhex(f.stem), st.st_size))
            except (OSError, ValueError):
                continue
        for _, key, size in sorted(found):
            self.files[key] = size
            self.bytes += size
        self._trim()

    def path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + SUFFIX)

    def __contains__(self, key: bytes) -> bool:
        return key in self.files

    def __len__(self) -> int:
        return len(self.files)

    def put(self, key: bytes, parts: Block) -> None:
        if key in self.files:
            self._touch(key)
            return
        parts = tuple(p.detach().to("cpu").contiguous() for p in parts)
        meta = {"format": FORMAT, "key": key.hex(), "salt": self.salt.hex(), "dtype": self._dtype_names(),
                "shape": json.dumps([list(s) for s in self.shapes]), "sha256": _digest(parts)}
        data = st_save({f"t{i}": p for i, p in enumerate(parts)}, metadata=meta)
        final = self.path(key)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, final)
        except OSError:
            tmp.unlink(missing_ok=True)
            return  # a full or read-only disk: the block is just not kept
        self.files[key] = len(data)
        self.bytes += len(data)
        self._trim()

    def get(self, key: bytes) -> Block | None:
        """The block's tensors, or None (absent, or invalid: then the file is deleted)."""
        if key not in self.files:
            return None
        p = self.path(key)
        try:
            data = p.read_bytes()
        except FileNotFoundError:  # deleted by another engine sharing the folder: a miss
            self.bytes -= self.files.pop(key, 0)
            return None
        try:
            got = self._validate(key, data)
        except Exception:  # noqa: BLE001 - any malformed file is ignored, never served
            got = None
        if got is None:
            self.invalid += 1
            self._drop(key)
            return None
        self._touch(key)
        return got

    def _touch(self, key: bytes) -> None:
        self.files.move_to_end(key)
        try:
            os.utime(self.path(key))  # recency survives a restart
        except OSError:
            pass

    def _validate(self, key: bytes, data: bytes) -> Block | None:
        meta = _metadata(data)
        if (meta.get("format") != FORMAT or meta.get("key") != key.hex() or meta.get("salt") != self.salt.hex()
                or meta.get("dtype") != self._dtype_names()
                or meta.get("shape") != json.dumps([list(s) for s in self.shapes])):
            return None
        t = st_load(data)
        parts = tuple(t.get(f"t{i}") for i in range(len(self.shapes)))
        if len(t) != len(self.shapes) or any(p is None or tuple(p.shape) != s for p, s in zip(parts, self.shapes)):
            return None
        if any(p.dtype != d for p, d in zip(parts, self.dtypes)) or meta.get("sha256") != _digest(parts):
            return None
        return parts

    def _dtype_names(self) -> str:
        return ",".join(str(d) for d in self.dtypes)

    def _drop(self, key: bytes) -> None:
        self.bytes -= self.files.pop(key, 0)
        self.path(key).unlink(missing_ok=True)

    def _trim(self) -> None:
        while self.bytes > self.limit and self.files:
            self._drop(next(iter(self.files)))
            self.evictions += 1
