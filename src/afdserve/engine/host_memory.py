"""Host allocator settings of an engine process (glibc's malloc).

A decode step allocates and frees the same large tensors every step (logits: rows x vocab floats,
the LM head's and the experts' outputs). glibc serves blocks above its mmap threshold with fresh
``mmap``s and returns freed heap tops to the system, so every step pays page faults on megabytes of
new memory (docs/performance.md measures what keeping them gains; vLLM asks for tcmalloc for the
same reason). ``keep_freed_memory``
raises the mmap threshold to its 32 MiB maximum and keeps up to 1 GiB of freed memory (and pads the
heap by 256 MiB), so those blocks are reused. A process started with any ``MALLOC_*_`` variable of
these settings keeps the user's choice; anything but glibc is left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 1 << 30, M_TOP_PAD: 256 << 20}
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_done = False


def keep_freed_memory() -> bool:
    """Applies ``SETTINGS`` once per process; True if they are in effect."""
    global _done
    if _done:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or any(v in os.environ for v in _ENV):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _done = all(libc.mallopt(param, value) == 1 for param, value in SETTINGS.items())
    except (OSError, AttributeError):
        return False
    return _done
