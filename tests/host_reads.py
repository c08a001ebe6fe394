"""A detector of host reads: what would make the host wait for the device on a GPU.

Inside ``no_host_reads()`` every operation that reads a tensor's values back to the host -- ``.item()``,
``bool()``/``int()``/``float()`` of a tensor, ``.tolist()``, ``.numpy()``, ``.cpu()``, a copy to the
CPU, or an op whose output shape depends on the values (``nonzero``, a boolean-mask index,
``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` without its output size) -- is
recorded, with the line of afdserve's code that made it. It runs on CPU tensors, where none of them
costs anything, so a test on this machine fails when one is added to a path meant to stay on the
device.
"""

from __future__ import annotations

import traceback
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_READ_METHODS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu,
                 torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}
_aten = torch.ops.aten
_DATA_DEPENDENT = {_aten._local_scalar_dense.default, _aten.nonzero.default, _aten.masked_select.default,
                   _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default,
                   _aten.bincount.default, _aten.nonzero_static.default}


def _where() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/afdserve/" in frame.filename.replace("\\", "/") and "/tests/" not in frame.filename:
            return f"{frame.filename.rsplit('/afdserve/', 1)[1]}:{frame.lineno} {frame.line}"
    return "?"


class _Methods(TorchFunctionMode):
    def __init__(self, found: list[str]):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READ_METHODS:
            self.found.append(f"{getattr(func, '__name__', func)} at {_where()}")
        elif func is torch.Tensor.__getitem__ or func is torch.Tensor.__setitem__:
            idx = args[1] if len(args) > 1 else None
            for i in idx if isinstance(idx, tuple) else (idx,):
                if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
                    self.found.append(f"boolean-mask index at {_where()}")
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    def __init__(self, found: list[str]):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DATA_DEPENDENT or (func.overloadpacket is _aten.repeat_interleave
                                       and kwargs.get("output_size") is None):
            self.found.append(f"{func} at {_where()}")
        return func(*args, **kwargs)


@contextmanager
def no_host_reads():
    """Yields the list of host reads made inside (empty: none)."""
    found: list[str] = []
    with _Methods(found), _Ops(found):
        yield found
