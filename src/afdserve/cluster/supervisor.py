"""Membership of a cluster: which workers are up, the replacement of one that died or stalled, and
the workers added or removed when a pool is resized (the same epochs).

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
from typing import Any

log = logging.getLogger("afdserve.cluster")

MAX_FAILED_STARTS = 3  # a replacement that dies this many times in a row before it is ready: give up
# a request in flight through this many worker crashes (errors the worker raised), with no token of it
# between them, fails instead of being run again: a fault it triggers every time would otherwise
# have its worker replaced forever
MAX_CRASHES_PER_REQUEST = 3


@dataclass
class Recovery:
    epoch: int
    started: float = field(default_factory=time.monotonic)
    starting: set[str] = field(default_factory=set)  # replacements not ready yet
    regrouping: set[str] = field(default_factory=set)  # survivors that have not acknowledged the epoch
    resize: bool = False  # a pool was resized on request (not a fault)
    degraded: bool = False  # expert replacements deferred: the others serve around them, then all rejoin

    @property
    def done(self) -> bool:
        return not self.starting and not self.regrouping


@dataclass
class Membership:
    """The front end's view of its workers: state, restarts, last failure, the current epoch."""

    group: str  # the deployment's name; epoch e's M2N group is f"{group}.{e}" (epoch 0: the name itself)
    epoch: int = 0
    state: dict[str, str] = field(default_factory=dict)  # worker -> "up" | "restarting" | "starting"
    restarts: dict[str, int] = field(default_factory=dict)
    last_failure: dict[str, str] = field(default_factory=dict)
    failed_starts: dict[str, int] = field(default_factory=dict)
    recovery: Recovery | None = None
    recovery_seconds: list[float] = field(default_factory=list)  # how long each recovery took
    resize_seconds: list[float] = field(default_factory=list)  # how long each resize took
    degraded_since: float | None = None  # a degraded epoch is complete: its replacements must rejoin

    def pending(self, name: str) -> bool:
        """``name`` is a replacement or an added worker that is not ready yet."""
        return self.state.get(name) in ("restarting", "starting")

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

    def resize(self, added: list[str], removed: list[str], survivors: list[str]) -> Recovery:
        """A new epoch in which ``added`` start and ``removed`` are gone; the survivors regroup."""
        self.epoch += 1
        for name in removed:
            self.state.pop(name, None)
        rec = Recovery(self.epoch, starting=set(added), regrouping=set(survivors), resize=True)
        for name in added:
            self.state[name] = "starting"
        self.recovery = rec
        log.warning("resizing: +%s -%s (membership epoch %d)", added, removed, self.epoch)
        return rec

    def rejoin(self, names: list[str]) -> Recovery:
        """A new epoch with every worker connected again (after a degraded one)."""
        self.epoch += 1
        started, self.degraded_since = self.degraded_since or time.monotonic(), None
        self.recovery = Recovery(self.epoch, started=started, regrouping=set(names))
        return self.recovery

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
            if rec.degraded:  # the others serve around the replacements, which are loaded: now they rejoin
                self.degraded_since = rec.started
                return False
            took = time.monotonic() - rec.started
            (self.resize_seconds if rec.resize else self.recovery_seconds).append(took)
            log.warning("membership epoch %d complete: every worker up (%.1f s after the %s)", rec.epoch, took,
                        "resize" if rec.resize else "loss")
            return True
        return False

    def start_failed(self, name: str) -> bool:
        """A replacement died before it was ready; True when it should not be tried again."""
        self.failed_starts[name] = self.failed_starts.get(name, 0) + 1
        return self.failed_starts[name] >= MAX_FAILED_STARTS


@dataclass
class CrashCounts:
    """Per request: the worker crashes it was in flight through since its last token."""

    counts: dict[str, int] = field(default_factory=dict)

    def progressed(self, request_id: str) -> None:
        """A token of the request arrived (or it finished): its count starts again."""
        self.counts.pop(request_id, None)

    def crashed(self, request_ids: list[str]) -> list[str]:
        """Counts one crash against each of ``request_ids``; returns those that reached
        ``MAX_CRASHES_PER_REQUEST`` (forgotten here: the caller fails them)."""
        out = []
        for rid in request_ids:
            self.counts[rid] = self.counts.get(rid, 0) + 1
            if self.counts[rid] >= MAX_CRASHES_PER_REQUEST:
                out.append(rid)
                del self.counts[rid]
        return out


@dataclass
class Heartbeats:
    """When the front end last heard from each worker (any message counts; every worker sends a
    ``Heartbeat`` from a thread of its own several times per ``timeout``). A worker silent for longer
    than ``timeout`` is stalled (SIGSTOPped, a frozen host) or gone. If the front end itself did not
    look for a while (a long control call), nobody is judged until they had ``timeout`` to speak again."""

    timeout: float
    last: dict[str, float] = field(default_factory=dict)
    looked: float = field(default_factory=time.monotonic)

    def heard(self, name: str) -> None:
        self.last[name] = time.monotonic()

    def stalled(self, names: list[str]) -> list[tuple[str, float]]:
        """(worker, seconds silent) for each of ``names`` silent for longer than ``timeout``."""
        now = time.monotonic()
        if now - self.looked > self.timeout / 2:  # we were away: every worker gets a fresh start
            self.last = {n: now for n in self.last}
        self.looked = now
        return [(n, now - self.last.setdefault(n, now)) for n in names
                if now - self.last.setdefault(n, now) > self.timeout]


def serve_around(starting: set[str], experts: list[str], config: Any, expert_map: Any) -> tuple[int, ...]:
    """The expert workers (indices) that the others serve around while they are replaced: with
    ``on_expert_loss="drop"`` any, with "wait" only those whose every expert has a replica on
    another worker (outputs do not change); none when an attention worker is lost too, with the
    expert-side gate, or when no expert worker is left. Empty: every step waits for the
    replacements."""
    if not starting <= set(experts) or config.gate != "attention" or starting == set(experts):
        return ()
    missing = tuple(sorted(experts.index(n) for n in starting))
    if config.on_expert_loss == "drop":
        return missing
    return () if bool(expert_map.without(set(missing)).lost_experts().any()) else missing
