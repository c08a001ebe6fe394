"""The fixed-size message header and the payload layout (no pickling anywhere on the data path).

A slot holds ``HEADER_BYTES`` of header followed by the payload. The payload is the tensors' bytes,
each tensor starting at a multiple of ``ALIGN`` bytes (so any dtype can be viewed in place).

Header (little endian, 1024 bytes):
  0   u32 magic, u16 version, u16 n_tensors, u16 n_ints, u16 flags, i32 kind
  16  u64 seq, u64 payload_bytes (the completion's size)
  32  i64 step, microbatch, layer, num_tokens, tag
  128 n_tensors x {u8 dtype, u8 ndim, u16 -, u32 -, u64 offset, i64 shape[MAX_NDIM]}  (MAX_TENSORS)
  640 n_ints x i64  (MAX_META_INTS)
"""

from __future__ import annotations

import struct
from typing import Iterable, NamedTuple, Sequence

import torch

from afdserve.comm.errors import PayloadTooLargeError
from afdserve.comm.message import Meta

HEADER_BYTES = 1024
ALIGN = 64
MAX_TENSORS = 8
MAX_NDIM = 6
MAX_META_INTS = 48
MAGIC = 0xAFD0_2024
VERSION = 2

FLAG_BYE = 1  # orderly close: no more messages on this pair

_FIXED_FMT = "IHHHHiQQqqqqq56x"  # 128 bytes, then the tensor records
_TENSOR_FMT = "BBHIQ" + "q" * MAX_NDIM  # 64 bytes
_FIXED = struct.Struct("<" + _FIXED_FMT)
_COUNT = struct.Struct("<H")  # n_tensors, at byte 6
_TENSOR = struct.Struct("<" + _TENSOR_FMT)
_HEAD = [struct.Struct("<" + _FIXED_FMT + _TENSOR_FMT * n) for n in range(MAX_TENSORS + 1)]
_TENSORS_AT = _FIXED.size
_INTS_AT = _TENSORS_AT + MAX_TENSORS * _TENSOR.size
_INTS = [struct.Struct("<" + "q" * n) for n in range(MAX_META_INTS + 1)]
assert _FIXED.size == 128 and _TENSOR.size == 64 and _INTS_AT + MAX_META_INTS * 8 == HEADER_BYTES
_PAD_SHAPE = [(0,) * (MAX_NDIM - n) for n in range(MAX_NDIM + 1)]

_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8",
                "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
CODE_OF: dict[torch.dtype, int] = {}
DTYPE_OF: dict[int, torch.dtype] = {}
for _code, _name in enumerate(_DTYPE_NAMES, start=1):
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        CODE_OF[_dt] = _code
        DTYPE_OF[_code] = _dt


class TensorDesc(NamedTuple):
    """Where one tensor of a message lies in the payload."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the payload
    nbytes: int


class Header(NamedTuple):
    seq: int
    flags: int
    payload_bytes: int
    meta: Meta
    tensors: tuple[TensorDesc, ...]


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def payload_nbytes(specs: Iterable[torch.Tensor | tuple[Sequence[int], torch.dtype]]) -> int:
    """Bytes a payload of these tensors (or ``(shape, dtype)`` pairs) occupies in a slot."""
    total = 0
    for s in specs:
        if isinstance(s, torch.Tensor):
            n = s.nbytes
        else:
            shape, dtype = s
            numel = 1
            for d in shape:
                numel *= int(d)
            n = numel * dtype.itemsize
        total = _round_up(total, ALIGN) + n
    return _round_up(total, ALIGN)


def plan(tensors: Sequence[torch.Tensor], capacity: int, peer: str) -> tuple[list[TensorDesc], int]:
    """Lay the tensors out in a payload; raise PayloadTooLargeError if it does not fit."""
    if len(tensors) > MAX_TENSORS:
        raise PayloadTooLargeError(f"to {peer!r}: {len(tensors)} tensors, at most {MAX_TENSORS} per message")
    descs: list[TensorDesc] = []
    off = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"to {peer!r}: payload item {len(descs)} is a {type(t).__name__}, expected a tensor")
        dtype = t.dtype
        if dtype not in CODE_OF:
            raise TypeError(f"to {peer!r}: dtype {dtype} of tensor {len(descs)} is not supported")
        shape = t.shape
        if len(shape) > MAX_NDIM:
            raise PayloadTooLargeError(f"to {peer!r}: tensor {len(descs)} has {len(shape)} dims, at most {MAX_NDIM}")
        nbytes = t.nbytes
        descs.append(TensorDesc(dtype, tuple(shape), off, nbytes))
        off = (off + nbytes + ALIGN - 1) // ALIGN * ALIGN
    if off > capacity:
        raise PayloadTooLargeError(
            f"to {peer!r}: payload of {off} bytes (tensors padded to {ALIGN} B) exceeds the receiver's "
            f"slot capacity of {capacity} bytes; raise CommConfig.slot_bytes on the receiving side")
    return descs, off


def encode_into(buf, offset: int, seq: int, meta: Meta, descs: Sequence[TensorDesc], payload_bytes: int,
                flags: int = 0) -> None:
    """Write a header at ``buf[offset:offset+HEADER_BYTES]`` (buf: a writable buffer)."""
    step, mb, layer, ntok, tag, ints, kind = meta
    if len(ints) > MAX_META_INTS:
        raise PayloadTooLargeError(f"Meta.ints has {len(ints)} values, at most {MAX_META_INTS}")
    args = [MAGIC, VERSION, len(descs), len(ints), flags, kind, seq, payload_bytes, step, mb, layer, ntok, tag]
    for d in descs:
        shape = d.shape
        args += (CODE_OF[d.dtype], len(shape), 0, 0, d.offset, *shape, *_PAD_SHAPE[len(shape)])
    _HEAD[len(descs)].pack_into(buf, offset, *args)
    if ints:
        _INTS[len(ints)].pack_into(buf, offset + _INTS_AT, *ints)


def decode(buf, offset: int = 0) -> Header:
    """Read a header written by ``encode_into``; raises ValueError on a corrupt header."""
    n_t = _COUNT.unpack_from(buf, offset + 6)[0]
    if n_t > MAX_TENSORS:
        raise ValueError(f"corrupt message header ({n_t} tensors)")
    v = _HEAD[n_t].unpack_from(buf, offset)
    magic, version, n_i = v[0], v[1], v[3]
    if magic != MAGIC or version != VERSION or n_i > MAX_META_INTS:
        raise ValueError(f"corrupt message header (magic={magic:#x}, version={version})")
    descs = []
    for i in range(13, 13 + 11 * n_t, 11):
        dtype = DTYPE_OF[v[i]]
        shape = v[i + 5: i + 5 + v[i + 1]]
        numel = 1
        for d in shape:
            numel *= d
        descs.append(TensorDesc(dtype, shape, v[i + 4], numel * dtype.itemsize))
    ints = _INTS[n_i].unpack_from(buf, offset + _INTS_AT) if n_i else ()
    return Header(v[6], v[4], v[7], Meta(v[8], v[9], v[10], v[11], v[12], ints, v[5]), tuple(descs))
