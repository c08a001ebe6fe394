"""POSIX shared-memory segments named ``afd_<owner pid>_<random>`` in /dev/shm.

The receiver of a pair creates the segment (its registered buffer), the sender maps it, and the
receiver unlinks the name as soon as the sender has confirmed the mapping: from then on nothing is
left in /dev/shm whatever happens to either process, and the memory goes away with the last mapping.
A segment still linked when its creator exits is unlinked by an atexit hook; ``sweep_shm`` removes
the leftovers of a creator killed inside that short window (a launcher can call it after a crash).
"""

from __future__ import annotations

import atexit
import mmap
import os
import re
import secrets
import threading
from typing import Iterable

SHM_DIR = "/dev/shm"
PREFIX = "afd_"
_NAME = re.compile(r"^afd_(\d+)_[0-9a-f]+$")

_linked: set[str] = set()  # names this process created and has not unlinked yet
_lock = threading.Lock()


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


class Segment:
    """One mapped shared-memory segment."""

    def __init__(self, name: str, mm: mmap.mmap, size: int, owner: bool) -> None:
        self.name = name
        self.mm = mm
        self.size = size
        self.owner = owner

    @classmethod
    def create(cls, size: int) -> "Segment":
        """Create, size (allocating every page now: no SIGBUS later if /dev/shm fills) and map."""
        name = f"{PREFIX}{os.getpid()}_{secrets.token_hex(8)}"
        fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        with _lock:
            _linked.add(name)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError:
                os.ftruncate(fd, size)  # a filesystem without fallocate: sparse but usable
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            os.close(fd)
            unlink(name)
            raise
        os.close(fd)
        return cls(name, mm, size, owner=True)

    @classmethod
    def attach(cls, name: str, size: int) -> "Segment":
        if not _NAME.match(name):
            raise ValueError(f"not an afdserve segment name: {name!r}")
        fd = os.open(_path(name), os.O_RDWR)
        try:
            if os.fstat(fd).st_size < size:
                raise ValueError(f"segment {name} is smaller than {size} bytes")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        return cls(name, mm, size, owner=False)

    def unlink(self) -> None:
        if self.owner:
            unlink(self.name)

    def close(self) -> None:
        """Unlink (if ours) and unmap; the mapping survives while tensors still view it."""
        self.unlink()
        try:
            self.mm.close()
        except BufferError:  # views still exported (a Message held past close); freed by GC
            pass


def unlink(name: str) -> None:
    with _lock:
        _linked.discard(name)
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (dead, not yet reaped) still answers kill(0)
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def list_segments() -> list[str]:
    """Names of afdserve segments currently in /dev/shm."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if _NAME.match(n))
    except FileNotFoundError:
        return []


def sweep_shm(pids: Iterable[int] | None = None) -> list[str]:
    """Unlink afdserve segments created by ``pids`` (default: by processes that no longer run).

    Returns the names removed. Only call it with explicit pids when those processes are gone.
    """
    wanted = None if pids is None else {int(p) for p in pids}
    removed = []
    for name in list_segments():
        m = _NAME.match(name)
        assert m is not None
        pid = int(m.group(1))
        if (wanted is not None and pid in wanted) or (wanted is None and pid != os.getpid() and not pid_alive(pid)):
            unlink(name)
            removed.append(name)
    return removed


@atexit.register
def _unlink_all_at_exit() -> None:
    with _lock:
        names = list(_linked)
    for n in names:
        unlink(n)
