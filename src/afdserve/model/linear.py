"""Linear projections with weights packed once for the CPU's GEMMs.

Two backends, both over a copy of the weight reordered once and kept (keyed by the weight's
storage, shape and strides, for as long as the weight's base tensor lives; made again when the
weight changes in place -- its version counter moves; an inference tensor has none, so whoever
changes one in place calls ``forget``):

* afdserve's linear kernel (``afdserve.kernels.linear``, bfloat16 and float32): one call per product,
  little fixed cost for the few-row products of decoding, float32 outputs on request (the LM head's
  logits) -- used wherever it is built;
* oneDNN's packed linear (bfloat16 only), where the kernels are not built: the same bits as
  ``F.linear`` in bf16 (``tests/test_packed_weights.py``).

Everything else (CUDA, float16, ``AFDSERVE_PACKED_WEIGHTS=0``) is ``F.linear``. It is a custom op
(``afdserve::packed_linear``), so ``torch.compile`` graphs call it as it is. The packed copy doubles
the memory of the weights that use it.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from afdserve import kernels
from afdserve.kernels.linear import linear as kernel_linear
from afdserve.kernels.linear import linear_argmax as kernel_linear_argmax
from afdserve.kernels.linear import linear_out as kernel_linear_out
from afdserve.kernels.linear import pack
from afdserve.kernels.packing import BLOCK
from afdserve.model.greedy import Best, argmax_rows

# the batch size oneDNN is told to optimise the layout for (the decode batch of a few to a few
# hundred rows; measured not to matter much between 16 and 128)
_ROWS_HINT = 64

# how a weight becomes the [N, K] matrix that is packed (applied only when packing)
PLAIN, STACKED, SIDE_BY_SIDE = 0, 1, 2

_available: bool | None = None
_switched_on: bool | None = None
# (data_ptr, shape, stride, layout) -> (weak reference to the weight's base, version, packed [N, K])
_packed: dict[tuple, tuple[weakref.ref, int, torch.Tensor]] = {}


def packing_switched_on() -> bool:
    """Packed weights are not switched off (``AFDSERVE_PACKED_WEIGHTS=0``)."""
    global _switched_on
    if _switched_on is None:
        _switched_on = os.environ.get("AFDSERVE_PACKED_WEIGHTS", "1") != "0"
    return _switched_on


def packing_available() -> bool:
    """oneDNN with bf16 GEMMs on this CPU, and packing not switched off."""
    global _available
    if _available is None:
        try:
            _available = packing_switched_on() and bool(
                torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            _available = False
    return _available


def reset_packing(keep_packed: bool = False) -> None:
    """Reads ``AFDSERVE_PACKED_WEIGHTS`` again; drops every packed copy unless ``keep_packed``."""
    global _available, _switched_on
    _available = _switched_on = None
    if not keep_packed:
        _packed.clear()


def packs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``linear`` runs ``x @ w.T`` through a packed weight: afdserve's kernel where it runs
    (whether or not oneDNN has bf16 GEMMs on this CPU), else oneDNN's for bfloat16."""
    return x.dtype == w.dtype and w.device.type == "cpu" and packing_switched_on() and (
        _kernel(x) or (w.dtype == torch.bfloat16 and packing_available()))


def _kernel(x: torch.Tensor) -> bool:
    """afdserve's linear kernel runs for ``x`` (else oneDNN's)."""
    return kernels.supports("linear", x) and (x.dtype == torch.float32 or x.shape[-1] % 2 == 0)


def _layout(w: torch.Tensor, layout: int) -> torch.Tensor:
    if layout == STACKED:  # [n, N, K] expert weights as one [n*N, K] matrix (outputs side by side)
        return w.reshape(-1, w.shape[-1])
    if layout == SIDE_BY_SIDE:  # [n, H, I] down weights as one [H, n*I] matrix (sums the experts)
        return w.permute(1, 0, 2).reshape(w.shape[1], -1)
    return w


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, layout: int = PLAIN,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` the ``layout`` of ``w`` (``PLAIN``: ``w`` itself), in ``out_dtype``
    (default: x's; float32 is computed as such by the kernel, not rounded first)."""
    if packs(x, w):
        if torch.compiler.is_compiling():  # the op, opaque to the compiler
            y = torch.ops.afdserve.packed_linear(x, w, bias, layout)
        else:
            y = _packed_linear(x, w, bias, layout, out_dtype)  # eager: without the custom op's Python dispatch
    else:
        y = F.linear(x, _layout(w, layout), bias)
    return y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)


def linear_rows(x: torch.Tensor, w: torch.Tensor, start: int, end: int,
                out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w[start:end].T``: the outputs ``[start, end)`` of ``w`` (a piece of the LM head), through
    the packed copy of the whole of ``w`` (made once) where the kernel runs and ``start`` is a
    multiple of 32; else as ``linear`` of the slice. With ``out`` (2-D ``x``; ``out`` [M, end -
    start] of ``out_dtype``, unit column stride: a column range of the whole logits) the kernel
    writes there, with no intermediate tensor and copy."""
    if start % BLOCK == 0 and _rows_kernel(x, w):
        packed = _packed_weight(w, PLAIN, True)[start // BLOCK: -(-end // BLOCK)]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        if out is not None and out.stride(-1) == 1:
            kernel_linear_out(x2, packed, end - start, out)
            return out
        y = kernel_linear(x2, packed, end - start, None, out_dtype).view(*x.shape[:-1], end - start)
    else:
        y = linear(x, w[start:end], out_dtype=out_dtype)
    return y if out is None else out.copy_(y)


def lm_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 logits ``x @ w.T`` of the whole vocabulary: into a new tensor by the in-place kernel
    (``linear_rows``, which writes big logits past the caches) where it runs, else ``linear``."""
    if _rows_kernel(x, w):
        out = torch.empty(*x.shape[:-1], w.shape[0], dtype=torch.float32, device=x.device)
        return linear_rows(x.reshape(-1, x.shape[-1]), w, 0, w.shape[0], torch.float32,
                           out=out.view(-1, w.shape[0])).view(out.shape)
    return linear(x, w, out_dtype=torch.float32)


def lm_head_argmax(x: torch.Tensor, w: torch.Tensor, best: Best, start: int = 0, end: int | None = None) -> None:
    """Merges into ``best`` each row of ``x`` [M, K]'s largest float32 logit of ``x @ w[start:end].T``
    and its vocabulary index (``model.greedy``'s choice): by the kernel on the packed copy of ``w``,
    writing no logits, where it runs (``start`` a multiple of 32), else from the logits."""
    end = w.shape[0] if end is None else end
    if start % BLOCK == 0 and _rows_kernel(x, w) and best.val.device == x.device:
        packed = _packed_weight(w, PLAIN, True)[start // BLOCK: -(-end // BLOCK)]
        kernel_linear_argmax(x.contiguous(), packed, end - start, start, into=(best.val, best.idx))
        return
    logits = linear(x, w[start:end], out_dtype=torch.float32)
    idx = argmax_rows(logits)
    best.merge(logits.gather(1, idx[:, None])[:, 0], idx + start)


def kernel_weight(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of ``w`` afdserve's linear kernel multiplies ``x`` with (made once), or None
    where ``linear`` would not run that kernel for ``x`` (what a fused kernel built of it needs)."""
    return _packed_weight(w, PLAIN, True) if _rows_kernel(x, w) else None


def _rows_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    """``linear_rows`` runs afdserve's kernel on the packed copy of the whole ``w`` (not compiling)."""
    return packs(x, w) and _kernel(x) and not torch.compiler.is_compiling()


def forget(w: torch.Tensor) -> None:
    """Drops the packed copies of ``w`` and of views into it (whatever layout): call after
    changing an inference tensor in place."""
    lo = w.data_ptr()
    hi = lo + w.numel() * w.element_size()
    for key in [k for k in _packed if lo <= k[0] < hi]:
        del _packed[key]


def _packed_weight(w: torch.Tensor, layout: int, kernel: bool) -> torch.Tensor:
    key = (w.data_ptr(), tuple(w.shape), w.stride(), layout, kernel)
    version = -1 if w.is_inference() else w._version
    hit = _packed.get(key)
    if hit is not None and hit[0]() is not None and hit[1] == version:
        return hit[2]
    base = w if w._base is None else w._base
    if kernel:
        packed = pack(_layout(w, layout))
    else:
        packed = torch.ops.mkldnn._reorder_linear_weight(_layout(w, layout).contiguous(), _ROWS_HINT)
    _packed[key] = (weakref.ref(base, lambda _, key=key: _packed.pop(key, None)), version, packed)
    return packed


def _packed_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, layout: int,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if _kernel(x):
        n = w.shape[1] if layout == SIDE_BY_SIDE else (w.shape[0] * w.shape[1] if layout == STACKED else w.shape[0])
        y = kernel_linear(x.reshape(-1, x.shape[-1]).contiguous(), _packed_weight(w, layout, True), n,
                          None if bias is None else bias.float(), out_dtype)
        return y.view(*x.shape[:-1], n)
    return torch.ops.mkldnn._linear_pointwise(x, _packed_weight(w, layout, False), bias, "none", [], "")


@torch.library.custom_op("afdserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, layout: int) -> torch.Tensor:
    """oneDNN's linear over the packed copy of ``w`` (see the module)."""
    return _packed_linear(x, w, bias, layout)


@packed_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, layout: int) -> torch.Tensor:
    n = w.shape[1] if layout == SIDE_BY_SIDE else (w.shape[0] * w.shape[1] if layout == STACKED else w.shape[0])
    return x.new_empty(*x.shape[:-1], n)


class Linear(nn.Linear):
    """``nn.Linear`` through ``linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
