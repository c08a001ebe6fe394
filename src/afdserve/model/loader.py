"""Reads the tensors of a Hugging Face safetensors checkpoint that one role needs.

An attention-side load reads embeddings, attention, norms, routers, shared experts and the LM
head; an expert-side load reads only the routed experts it was given. Reads go through
safetensors' memory map, so tensors that are not asked for are never touched; ``bytes_read``
counts what was asked for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open

from afdserve.errors import ModelError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def parse_device(name: str | torch.device) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``, checked against what this process's torch sees."""
    dev = torch.device(name)
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ModelError(f"unsupported device {str(name)!r}; use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ModelError(f"device {str(name)!r}: this torch ({torch.__version__}) sees no CUDA device")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ModelError(f"device {str(name)!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return torch.device("cuda", index)


class CheckpointReader:
    """Name -> tensor access over one or many safetensors files, with a byte counter."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.bytes_read = 0
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            self._where = {name: self.path / file for name, file in weight_map.items()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise ModelError(f"{self.path}: no *.safetensors files")
            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    for name in h.keys():
                        self._where[name] = f
        missing = {f for f in self._where.values() if not f.is_file()}
        if missing:
            raise ModelError(f"{self.path}: index names missing files {sorted(str(m.name) for m in missing)}")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> Iterable[str]:
        return self._where.keys()

    def _handle(self, name: str):
        if name not in self._where:
            raise ModelError(f"{self.path}: missing tensor {name!r}")
        f = self._where[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        return self._handles[f]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Reads a whole tensor, checking its shape."""
        got = self.shape(name)
        if got != tuple(shape):
            raise ModelError(f"{self.path}: tensor {name!r} has shape {list(got)}, expected {list(shape)}")
        t = self._handle(name).get_tensor(name)
        self.bytes_read += t.numel() * t.element_size()
        return t.to(dtype)

    def get_rows(self, name: str, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Reads ``tensor[index]`` of a stacked tensor without reading the other rows."""
        sl = self._handle(name).get_slice(name)
        full = tuple(sl.get_shape())
        if full[1:] != tuple(shape) or index >= full[0]:
            raise ModelError(
                f"{self.path}: tensor {name!r} has shape {list(full)}, expected [>{index}, {', '.join(map(str, shape))}]"
            )
        t = sl[index : index + 1][0]
        self.bytes_read += t.numel() * t.element_size()
        return t.to(dtype)

    def close(self) -> None:
        self._handles.clear()
