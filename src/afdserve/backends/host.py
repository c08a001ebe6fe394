"""What a worker's backend does with the machine while the worker waits for its peers.

The workers of a local deployment share one machine. A backend may put a waiting worker's cores to
use for the others (the cpu backend lends them to the kernels of the workers that compute:
``afdserve.backends.cpu.cores``); generic code only calls the hooks below around its waits and
before its sends, and elsewhere they do nothing. The front end creates the machine's ``Share``
(``create_share``) and its local workers inherit its descriptor and ``join`` it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

from afdserve.config import EngineConfig


class Share(Protocol):
    fd: int | None  # the descriptor local workers inherit

    def close(self) -> None: ...


class WorkerHooks(Protocol):
    def waiting(self) -> AbstractContextManager[None]:
        """Around a wait for peers' messages."""
        ...

    def sending(self, role: str, index: int) -> None:
        """Right before this worker sends to peer ``index`` of ``role`` ("attention" or "expert")."""
        ...

    def spin_yield(self) -> bool:
        """Whether a wait should sleep now instead of spinning (its core is in use by another)."""
        ...


class NoHooks:
    def waiting(self) -> AbstractContextManager[None]:
        return nullcontext()

    def sending(self, role: str, index: int) -> None:
        pass

    def spin_yield(self) -> bool:
        return False


def create_share(cfg: EngineConfig) -> Share | None:
    """The machine's share for a deployment: where its workers compute on the CPU, run locally, and
    lend their idle cores (``EngineConfig.lend_idle_cores``); None elsewhere."""
    devices = {cfg.device, cfg.expert_device or cfg.device}
    if devices != {"cpu"} or cfg.cluster != "local" or not cfg.lend_idle_cores:
        return None
    from afdserve.backends.cpu.cores import CoreBoard

    return CoreBoard.create()


def join(fd: int | None, role: str, index: int, threads: int) -> WorkerHooks:
    """A worker's hooks on the share it inherited as ``fd`` (None: none, the hooks do nothing)."""
    if fd is None:
        return NoHooks()
    from afdserve.backends.cpu.cores import join as join_board

    return join_board(fd, role, index, threads)
