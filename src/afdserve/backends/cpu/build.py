"""Builds the C++ CPU kernels once per machine and loads them into ``torch.ops.afdserve_kernels``.

The sources (``csrc/``) are compiled with PyTorch's extension builder for the CPU that builds them
(``-march=native``) into ``$AFDSERVE_CACHE/kernels/<key>``, where the key hashes the sources, the
torch and Python versions and the CPU's feature flags: another machine or version builds its own.
A later process loads the built library directly (no compiler run). ``scripts/setup.sh`` builds them
(``python -m afdserve.backends.cpu``), so the first engine does not wait for the compiler.

The kernels need AVX-512 (and AVX512-BF16 for bfloat16 GEMMs), or AVX2 with FMA and F16C;
``afdserve.backends.cpu.supports(kernel, dtype)`` says which run here. Anything that goes wrong (no
compiler, no ninja) leaves the kernels unavailable, with the reason in ``load().reason``; the torch
backends serve then (``afdserve.backends.choose``). ``AFDSERVE_KERNELS=0`` switches them off. Builds are serialized by a lock file
beside the build folder, so a build killed midway (which leaves the extension builder's own lock
behind) does not keep the next one waiting.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import sys
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from afdserve.config import cache_root, cpuinfo

NAME = "afdserve_kernels"
SOURCES = ("ops.cpp", "lend.cpp", "moe.cpp", "attention.cpp", "layers.cpp", "linear.cpp", "attention_half.cpp")
# -fopenmp: at::parallel_for runs on torch's OpenMP threads (the library links libgomp.so.1, which
# resolves to the copy torch already loaded: one thread pool, sized by torch.set_num_threads)
CFLAGS = ["-O3", "-march=native", "-std=c++17", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


@dataclass(frozen=True)
class Loaded:
    ok: bool
    reason: str = ""  # why not, when not ok
    path: str = ""  # the shared library


_state: Loaded | None = None
KERNELS = ("fused_moe", "linear", "paged_attention", "rms_norm", "rope_cache", "attention_half")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _csrc() -> Path:
    return Path(str(resources.files("afdserve.backends.cpu") / "csrc"))


def build_dir() -> Path:
    h = hashlib.sha256()
    for name in sorted(os.listdir(_csrc())):
        h.update(name.encode())
        h.update((_csrc() / name).read_bytes())
    for part in (torch.__version__, sys.version, " ".join(CFLAGS + LDFLAGS), cpuinfo("flags")):
        h.update(part.encode())
    return cache_root() / "kernels" / h.hexdigest()[:16]


def _library(directory: Path) -> Path:
    return directory / f"{NAME}.so"


def _compile(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time (released at the end of the block)
        if _library(directory).exists():  # another process built it meanwhile
            torch.ops.load_library(str(_library(directory)))
            return _library(directory)
        # the extension builder's own lock file, left by a build that was killed: stale, since
        # every build of this folder holds the lock above
        (directory / "lock").unlink(missing_ok=True)
        return _build(directory)


def _build(directory: Path) -> Path:
    from torch.utils import cpp_extension

    # ninja from this environment's bin (the `ninja` package) when PATH lacks it
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    cpp_extension.load(name=NAME, sources=[str(_csrc() / s) for s in SOURCES], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
                       build_directory=str(directory), is_python_module=False, verbose=False)
    return _library(directory)


def load(build: bool = True) -> Loaded:
    """Loads the kernels (building them first if ``build`` and they are not built yet); once per
    process."""
    global _state
    if _state is not None and (_state.ok or not build or _state.reason != "not built"):
        return _state
    if os.environ.get("AFDSERVE_KERNELS", "1") == "0":
        _state = Loaded(False, "switched off (AFDSERVE_KERNELS=0)")
        return _state
    if platform.machine() not in ("x86_64", "AMD64"):
        _state = Loaded(False, f"no kernels for {platform.machine()} (x86-64 only)")
        return _state
    directory = build_dir()
    lib = _library(directory)
    try:
        if not lib.exists():
            if not build:
                _state = Loaded(False, "not built")
                return _state
            lib = _compile(directory)
        else:
            torch.ops.load_library(str(lib))
    except Exception as e:  # no compiler, ninja, headers...: the torch backends serve
        _state = Loaded(False, f"build failed: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
        warnings.warn(f"afdserve kernels unavailable, using the torch backends: {_state.reason}", RuntimeWarning,
                      stacklevel=2)
        return _state
    from afdserve.backends.cpu import fakes

    fakes.register()
    _state = Loaded(True, path=str(lib))
    return _state


def main() -> int:
    state = load()
    if state.ok:
        from afdserve.backends.cpu import supports

        runs = [f"{k} ({', '.join(str(d).removeprefix('torch.') for d in DTYPES if supports(k, d))})" for k in KERNELS]
        print(f"afdserve: kernels ready ({state.path}): {'; '.join(runs)}")
    else:
        print(f"afdserve: kernels unavailable ({state.reason}); the torch backends will serve")
    return 0
