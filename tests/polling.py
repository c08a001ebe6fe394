"""Synchronizing tests on conditions, never on sleeps: ``assert wait_until(cond, timeout), why``.

``timeout`` only bounds how long a failing test waits; a passing one returns as soon as ``cond()``
holds, so it can be generous without slowing anything down."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(cond: Callable[[], object], timeout: float, interval: float = 0.01) -> bool:
    """Polls ``cond()`` every ``interval`` seconds until it is true (True) or ``timeout`` seconds
    have passed (False; ``cond()`` is checked once more at the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie is dead; the name in /proc's stat may hold spaces)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
