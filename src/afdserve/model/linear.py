"""Linear projections with weights prepacked for the CPU's GEMM library.

On a CPU with bf16 GEMM support, oneDNN runs a weight reordered once into its blocked layout about
twice as fast as ``F.linear`` for the few-row products of decoding (``benchmarks/linear_kernels.py``),
and gives the same bits. ``PackedWeight`` holds that reordered copy of one weight and makes it again
when the weight changes (its storage or version counter moved: a load, ``copy_``, a regroup; an
inference tensor has no version counter, so whoever changes one in place calls ``reset``).
Everywhere else (CUDA, float32, no oneDNN, inside ``torch.compile``, ``AFDSERVE_PACKED_WEIGHTS=0``)
it is ``F.linear``. Float32 stays on ``F.linear`` because the packed kernel rounds differently
there (~1e-5), which would break token identity with transformers.

The packed copy doubles the memory of the weights that use it (the expert layer's dense path, see
``ExpertPart``, keeps one more).
"""

from __future__ import annotations

import os
from functools import cache
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# the batch size oneDNN is told to optimise the layout for (the decode batch of a few to a few
# hundred rows; measured not to matter much between 16 and 128)
_ROWS_HINT = 64


@cache
def packing_available() -> bool:
    """oneDNN with bf16 GEMMs on this CPU, and not switched off."""
    if os.environ.get("AFDSERVE_PACKED_WEIGHTS", "1") == "0":
        return False
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def packs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``PackedWeight`` would run ``x @ w.T`` through a packed weight."""
    return (w.dtype == torch.bfloat16 and x.dtype == w.dtype and w.device.type == "cpu"
            and not torch.compiler.is_compiling() and packing_available())


class PackedWeight:
    """``F.linear(x, w, bias)`` through a reordered copy of ``w`` where that pays (see the module)."""

    __slots__ = ("_key", "_packed")

    def __reduce__(self) -> tuple:  # copies and pickles start empty: the packed tensor is per process
        return PackedWeight, ()

    def __init__(self) -> None:
        self._key: tuple[int, int, tuple[int, ...]] | None = None
        self._packed: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 layout: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """``x @ layout(w).T + bias``; ``layout`` (applied only when packing) makes the [N, K] matrix
        out of ``w``, which is then packed only when ``w`` itself changes."""
        if not packs(x, w):
            return F.linear(x, w if layout is None else layout(w), bias)
        # an inference tensor has no version counter: its in-place changes need ``reset``
        key = (w.data_ptr(), -1 if w.is_inference() else w._version, tuple(w.shape))
        if key != self._key:
            w2 = w if layout is None else layout(w)
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w2.contiguous(), _ROWS_HINT)
            self._key = key
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")

    def reset(self) -> None:
        """Forgets the packed copy (the next call packs the weight again)."""
        self._key = self._packed = None


class Linear(nn.Linear):
    """``nn.Linear`` whose product goes through a ``PackedWeight``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.packed = PackedWeight()  # a plain attribute: not in the state dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x, self.weight, self.bias)
