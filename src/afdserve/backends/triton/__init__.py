"""The ``triton`` backends (attention and norms): Triton kernels compiled for CUDA devices and run by
Triton's interpreter on CPU tensors (how CI tests them). Which of the two
is decided once per process, before triton is imported (``load``): Triton fixes it when its own
kernels are defined."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

import torch

from afdserve.errors import ConfigError


def unavailable_reason(device: torch.device) -> str:
    """Why the triton backend cannot run on ``device`` in this process ("" where it can)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device.type not in ("cpu", "cuda"):
        return f"the device is {device}: Triton runs CUDA devices (and CPU tensors, interpreted)"
    if "triton" in sys.modules:
        interpreted = _interpreted()
        if interpreted != (device.type == "cpu"):
            return (f"triton was imported {'interpreted' if interpreted else 'compiled'} in this process and {device} "
                    f"needs it {'compiled' if interpreted else 'interpreted'} ("
                    f"{'unset' if interpreted else 'set'} TRITON_INTERPRET=1 before triton is imported)")
    return ""


def load(device: torch.device, module: str = "kernels") -> ModuleType:
    """A kernels module (``kernels``: attention, ``norm_kernels``) for ``device``; on the CPU,
    Triton's interpreter (TRITON_INTERPRET=1 is set for this process and the processes it starts,
    before triton is imported)."""
    why = unavailable_reason(device)
    if why:
        raise ConfigError(f"the triton backend cannot run here: {why}")
    if device.type == "cpu" and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    return importlib.import_module(f"afdserve.backends.triton.{module}")


def _interpreted() -> bool:
    import triton.language.standard as standard

    return type(standard.cdiv).__name__ == "InterpretedFunction"
