"""Backends of the model's hot path, chosen once per engine (``choose``) and held by its layers.

* ``torch`` (``afdserve.backends.pytorch``): device-agnostic PyTorch -- what CUDA runs, and a CPU
  without afdserve's kernels;
* ``cpu`` (``afdserve.backends.cpu``): afdserve's C++ kernels, built once per machine;
* ``triton`` (``afdserve.backends.triton``, attention and norms): paged attention, RMS norm with the
  residual add and RoPE with the cache write in Triton, compiled for CUDA, interpreted on CPU tensors.

The interfaces are in ``afdserve.backends.base``; a step's context in ``afdserve.backends.step``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afdserve.backends.base import AttentionBackend, LinearBackend, MoEBackend, NormBackend
from afdserve.errors import ConfigError

NAMES = ("auto", "cpu", "torch", "triton")


@dataclass(frozen=True)
class Backends:
    attention: AttentionBackend
    moe: MoEBackend
    linear: LinearBackend
    norm: NormBackend

    def names(self) -> dict[str, str]:
        return {"attention": self.attention.name, "moe": self.moe.name, "linear": self.linear.name,
                "norm": self.norm.name}


def _cpu_kernels(dtype: torch.dtype) -> dict[str, str]:
    """Why each component's cpu backend cannot run ``dtype`` here ("" where it can)."""
    from afdserve.backends import cpu

    if not cpu.available():
        why = f"the CPU kernels are unavailable ({cpu.unavailable_reason()})"
        return dict.fromkeys(("attention", "moe", "linear", "norm"), why)
    need = {"attention": ("attention_half",), "moe": ("fused_moe",), "linear": ("linear",),
            "norm": ("rms_norm", "rope_cache")}
    return {part: "" if all(cpu.supports(k, dtype) for k in kernels) else f"no {'/'.join(kernels)} kernel for "
            f"{str(dtype).removeprefix('torch.')} on this CPU ({cpu.isa()})" for part, kernels in need.items()}


def choose(device: torch.device | str, dtype: torch.dtype, backend: str = "auto", *, attention: str | None = None,
           moe: str | None = None, latent: bool = False, fp8_kv: bool = False) -> Backends:
    """The backends of an engine on ``device`` computing in ``dtype``: ``backend`` for every component
    ("auto": cpu where the device is the CPU and the kernels run ``dtype`` here, else torch), with
    ``attention`` / ``moe`` overriding it for theirs ("triton": attention and norms, linear and MoE on
    torch).
    ``latent``: the model uses MLA (the torch attention backend runs it). ``fp8_kv``: the KV cache is
    FP8 (``afdserve.kvcache.fp8``), which the torch and triton attention backends read; the cpu one's
    kernels read caches in the model's dtype only, so "auto" attends on torch then (its norm, linear
    and MoE kernels stay). An explicit choice that cannot run raises ConfigError saying why."""
    device = torch.device(device)
    asked = {"attention": attention or backend, "moe": moe or backend, "linear": backend, "norm": backend}
    for part, name in asked.items():
        if name not in NAMES:
            raise ConfigError(f"invalid {part} backend {name!r}: use {', '.join(NAMES)}")
    if moe == "triton":
        raise ConfigError("invalid moe backend 'triton': triton is an attention backend (use auto, cpu or torch)")
    asked = {part: "torch" if name == "triton" and part in ("moe", "linear") else name for part, name in asked.items()}
    if device.type != "cpu":
        why = dict.fromkeys(asked, f"the device is {device}, not the CPU")
    elif any(name not in ("torch", "triton") for name in asked.values()):
        why = _cpu_kernels(dtype)  # loads (first: builds) the kernels
    else:
        why = dict.fromkeys(asked, "")
    for part in ("attention", "norm"):
        if asked[part] == "triton":
            from afdserve.backends.triton import unavailable_reason

            why[part] = unavailable_reason(device)
    if latent:
        why["attention"] = why["attention"] or "MLA's latent attention runs on the torch backend"
    if fp8_kv and asked["attention"] != "triton":
        why["attention"] = why["attention"] or "the cpu attention kernels read KV caches in the model's dtype, not fp8"
    chosen = {}
    for part in ("linear", "norm", "moe", "attention"):
        name = asked[part]
        if part == "attention" and name != "triton" and chosen["linear"] != "cpu":  # the fused half: packed weights
            why[part] = why[part] or "the cpu attention backend needs the cpu linear backend"
        if name in ("cpu", "triton") and why[part]:
            raise ConfigError(f"invalid {part} backend {name!r}: {why[part]}")
        chosen[part] = name if name in ("cpu", "triton") else "cpu" if name == "auto" and not why[part] else "torch"
    return _build(chosen, device, fp8_kv)


def _build(names: dict[str, str], device: torch.device, fp8_kv: bool) -> Backends:
    from afdserve.backends.pytorch.attention import TorchAttention
    from afdserve.backends.pytorch.linear import TorchLinear
    from afdserve.backends.pytorch.moe import TorchMoE
    from afdserve.backends.pytorch.norm import TorchNorm

    if "cpu" in names.values():
        from afdserve.backends.cpu.attention import CpuAttention
        from afdserve.backends.cpu.linear import CpuLinear
        from afdserve.backends.cpu.moe import CpuMoE
        from afdserve.backends.cpu.norm import CpuNorm
    if names["norm"] == "triton":
        from afdserve.backends.triton.norm import TritonNorm

        norm = TritonNorm(device)
    else:
        norm = CpuNorm() if names["norm"] == "cpu" else TorchNorm()
    if names["attention"] == "triton":
        from afdserve.backends.triton.attention import TritonAttention

        attention = TritonAttention(norm, device, fp8_kv)
    else:
        attention = CpuAttention() if names["attention"] == "cpu" else TorchAttention(norm, fp8_kv)
    return Backends(attention=attention,
                    moe=CpuMoE() if names["moe"] == "cpu" else TorchMoE(),
                    linear=CpuLinear() if names["linear"] == "cpu" else TorchLinear(), norm=norm)


def cpu_kernels() -> str:
    """The CPU kernels' instruction set here ("avx512+bf16", "avx512", "avx2"; "none": unavailable)."""
    from afdserve.backends import cpu

    return cpu.isa()
