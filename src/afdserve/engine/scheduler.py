"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Running sequences go first (one decode token each, or the next chunk of an unfinished prefill),
then waiting ones in arrival order while the token budget, the sequence limit and the free KV
blocks allow. When a running sequence needs a block and none is free, the most recently arrived
running sequence is preempted: its blocks are freed and it goes back to the front of the queue to
be recomputed later. Nothing is ever dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from afdserve.engine.sequence import Sequence, Status
from afdserve.kvcache.block_manager import BlockManager


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


@dataclass
class Batch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # tokens of each sequence computed this step
    preempted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def samples(self, i: int) -> bool:
        """Whether sequence i has all its tokens computed after this step (and so samples one)."""
        s = self.seqs[i]
        return s.num_computed + self.num_new[i] == s.num_tokens


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager):
        self.cfg, self.blocks = cfg, blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence and frees its blocks."""
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)

    def _preempt(self, seq: Sequence, batch: Batch) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.cfg.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self.blocks.can_hold(seq.seq_id, seq.num_computed + n):
                victim = self.running[-1]  # the latest arrival; never one already in this batch
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is Status.WAITING:
                break  # it preempted itself: everything after it is gone too
            self.blocks.reserve(seq.seq_id, seq.num_computed + n)
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n
            i += 1
        # Newly preempted sequences wait for the next step, so they don't take back blocks now.
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if seq in batch.preempted:
                break
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.blocks.can_hold(seq.seq_id, seq.num_computed + n):
                break
            self.waiting.popleft()
            self.blocks.reserve(seq.seq_id, seq.num_computed + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n
        return batch
