"""Membership of a cluster: which workers are up, and the replacement of one that died or stalled.

A lost worker is fenced (killed: a stalled process that wakes up finds itself gone) and a replacement
with the same role and index is launched into a new *membership epoch*: the M2N group of epoch e is
``<deployment>.e``, so no process of an older epoch can ever reach a peer of a newer one. The healthy
workers keep their processes, weights, KV caches and requests: they only connect their links anew
(``Regroup``). An attention worker whose step was interrupted runs it again; the requests of a lost
attention worker are re-admitted on its replacement with the tokens already sent (recomputed, not
repeated). A report of a lost peer from an older epoch is stale and ignored.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger("afdserve.cluster")

MAX_FAILED_STARTS = 3  # a replacement that dies this many times in a row before it is ready: give up


@dataclass
class Recovery:
    epoch: int
    started: float = field(default_factory=time.monotonic)
    starting: set[str] = field(default_factory=set)  # replacements not ready yet
    regrouping: set[str] = field(default_factory=set)  # survivors that have not acknowledged the epoch

    @property
    def done(self) -> bool:
        return not self.starting and not self.regrouping


@dataclass
class Membership:
    """The front end's view of its workers: state, restarts, last failure, the current epoch."""

    group: str  # the deployment's name; epoch e's M2N group is f"{group}.{e}" (epoch 0: the name itself)
    epoch: int = 0
    state: dict[str, str] = field(default_factory=dict)  # worker -> "up" | "restarting"
    restarts: dict[str, int] = field(default_factory=dict)
    last_failure: dict[str, str] = field(default_factory=dict)
    failed_starts: dict[str, int] = field(default_factory=dict)
    recovery: Recovery | None = None
    recovery_seconds: list[float] = field(default_factory=list)  # how long each recovery took

    def group_of(self, epoch: int) -> str:
        return self.group if epoch == 0 else f"{self.group}.{epoch}"

    def begin(self, lost: str, reason: str, survivors: list[str]) -> Recovery:
        """A new epoch in which ``lost`` is replaced; the survivors regroup."""
        self.epoch += 1
        self.restarts[lost] = self.restarts.get(lost, 0) + 1
        self.last_failure[lost] = reason
        prev = self.recovery
        rec = Recovery(self.epoch, started=prev.started if prev is not None else time.monotonic())
        rec.starting = ({lost} | (prev.starting if prev is not None else set())) - set(survivors)
        rec.regrouping = set(survivors)
        for name in rec.starting:
            self.state[name] = "restarting"
        self.recovery = rec
        log.warning("worker %s lost (%s): replacing it (membership epoch %d)", lost, reason, self.epoch)
        return rec

    def ready(self, name: str) -> bool:
        """A worker of the current epoch is up; True when the recovery is complete."""
        self.state[name] = "up"
        self.failed_starts.pop(name, None)
        rec = self.recovery
        if rec is None:
            return False
        rec.starting.discard(name)
        rec.regrouping.discard(name)
        if rec.done:
            self.recovery = None
            self.recovery_seconds.append(time.monotonic() - rec.started)
            log.warning("membership epoch %d complete: every worker up (%.1f s after the loss)", rec.epoch,
                        self.recovery_seconds[-1])
            return True
        return False

    def start_failed(self, name: str) -> bool:
        """A replacement died before it was ready; True when it should not be tried again."""
        self.failed_starts[name] = self.failed_starts.get(name, 0) + 1
        return self.failed_starts[name] >= MAX_FAILED_STARTS
