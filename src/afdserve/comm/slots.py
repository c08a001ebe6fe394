"""Registered memory: a fixed array of slots, each ``HEADER_BYTES`` of header plus the payload area.

Memory is registered once per pair (when it connects). Received tensors are views made with
``as_strided`` on a per-dtype view of the whole region, so a receive costs no copy.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np
import torch

from afdserve.comm.header import HEADER_BYTES, TensorDesc

PAGE = 4096


def slot_stride(slot_bytes: int) -> int:
    return (HEADER_BYTES + slot_bytes + PAGE - 1) // PAGE * PAGE


class SlotBuffer:
    """``num_slots`` slots laid out from ``base`` in ``mem`` (host memory) or in a uint8 tensor.

    Host memory (``mem``: a writable buffer such as an mmap) also exposes ``mv`` (a memoryview, for
    socket ``recv_into`` and header packing) and ``addr`` (for ``ctypes.memmove``).
    """

    def __init__(self, num_slots: int, slot_bytes: int, *, mem=None, tensor: torch.Tensor | None = None,
                 base: int = 0) -> None:
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.stride = slot_stride(slot_bytes)
        self.base = base
        size = base + num_slots * self.stride
        if tensor is None:
            self.mv: memoryview | None = memoryview(mem).cast("B")
            if len(self.mv) < size:
                raise ValueError(f"registered region of {len(self.mv)} bytes, need {size}")
            self._np = np.frombuffer(self.mv, dtype=np.uint8)
            self.addr: int = self._np.ctypes.data
            self.u8 = torch.frombuffer(self.mv, dtype=torch.uint8)
        else:
            self.mv = None
            self._np = None
            self.u8 = tensor
            self.addr = tensor.data_ptr() if tensor.device.type == "cpu" else 0
        self._typed: dict[torch.dtype, torch.Tensor] = {torch.uint8: self.u8}
        self.is_host = self.u8.device.type == "cpu"

    def header_offset(self, slot: int) -> int:
        return self.base + slot * self.stride

    def payload_offset(self, slot: int) -> int:
        return self.base + slot * self.stride + HEADER_BYTES

    def _view(self, dtype: torch.dtype) -> torch.Tensor:
        v = self._typed.get(dtype)
        if v is None:
            v = self.u8.view(dtype)
            self._typed[dtype] = v
        return v

    def tensor_at(self, byte_offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = len(shape)
        if n == 1:
            stride: tuple[int, ...] = (1,)
        elif n == 0:
            stride = ()
        else:
            acc, st = 1, []
            for d in reversed(shape):
                st.append(acc)
                acc *= d if d > 1 else 1
            stride = tuple(reversed(st))
        v = self._typed.get(dtype)
        if v is None:
            v = self._view(dtype)
        return v.as_strided(shape, stride, byte_offset // dtype.itemsize)

    def tensors(self, slot: int, descs: Sequence[TensorDesc]) -> list[torch.Tensor]:
        p = self.base + slot * self.stride + HEADER_BYTES
        return [self.tensor_at(p + d.offset, d.dtype, d.shape) for d in descs]

    def write(self, slot: int, tensors: Sequence[torch.Tensor], descs: Sequence[TensorDesc]) -> None:
        """Copy the tensors into the slot's payload area (one direct copy per tensor)."""
        p = self.base + slot * self.stride + HEADER_BYTES
        for t, d in zip(tensors, descs):
            if not d.nbytes:
                continue
            if self.is_host and t.is_cpu and t.is_contiguous():
                ctypes.memmove(self.addr + p + d.offset, t.data_ptr(), d.nbytes)
            else:
                self.tensor_at(p + d.offset, d.dtype, d.shape).copy_(t)

    def release(self) -> None:
        """Drop the views on the memory (so an mmap behind it can be closed)."""
        self._typed.clear()
        self.u8 = torch.empty(0, dtype=torch.uint8)
        self._np = None
        mv, self.mv = self.mv, None
        if mv is not None:
            try:
                mv.release()
            except BufferError:  # a Message the user still holds keeps the memory alive; GC frees it
                pass
