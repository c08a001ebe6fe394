"""The engine's allocator settings apply once, leave a user's MALLOC_* choice alone, and engines run
with them (every other test's engine does too)."""

import platform

import pytest

from afdserve.engine import host_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_applies_once_unless_the_user_chose(monkeypatch):
    monkeypatch.setattr(host_memory, "_done", False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert host_memory.keep_freed_memory() is False  # the user's setting stands
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    assert host_memory.keep_freed_memory() is True
    assert host_memory.keep_freed_memory() is True  # once is enough
