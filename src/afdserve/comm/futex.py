"""futex(2) wait/wake on a 32-bit word in shared memory, through ctypes (no compiled extension).

Shared-memory waiters block on a futex rather than on a socket: a socket (or pipe) wake-up is a
"synchronous" wake-up, which makes the scheduler pull the woken process onto the waker's CPU, so a
sender and its receiver end up time-sharing one core. A futex wake leaves the waiter on its own
(idle) CPU.
"""

from __future__ import annotations

import ctypes
import platform

_SYS_FUTEX = {"x86_64": 202, "AMD64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE_FLAG): the word is in a MAP_SHARED mapping


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = None
if _SYS_FUTEX is not None:
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    except OSError:  # pragma: no cover
        _libc = None

AVAILABLE = _libc is not None


def wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the u32 at ``addr`` equals ``expected``, at most ``timeout_s`` (GIL released)."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(expected),  # type: ignore[union-attr]
                  ctypes.byref(ts), None, 0)


def wake(addr: int) -> None:
    """Wake every waiter on the u32 at ``addr``."""
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)  # type: ignore[union-attr]
