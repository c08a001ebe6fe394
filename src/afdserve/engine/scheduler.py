"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Running sequences go first (one decode token each, or the next chunk of an unfinished prefill),
then waiting ones in arrival order while the token budget, the sequence limit and the free KV
blocks allow. When a running sequence needs a block and none is free, the most recently arrived
running sequence is preempted: its blocks are freed and it goes back to the front of the queue to
be recomputed later. Nothing is ever dropped.

With prefix caching, a waiting sequence starts with the longest chain of cached full blocks of its
tokens (``afdserve.kvcache.block_manager``), capped so that at least one token is computed (for its
logits) and, for a request asking for prompt logprobs, so that no logprob it still needs is skipped.
After each step the blocks filled by it are registered, so a preempted sequence's blocks stay cached.

A sequence with a part in a context-parallel prefill (``seq.cp``, ``afdserve.engine.cp``) waits in a
queue of its own and runs in a step of its own (``schedule_cp``), one at a time, in the order of
the front end's handles (every rank of its group runs them in that order): the owner allocates the
whole prompt's blocks first; after the step it decodes as any other sequence (a helper is done).
Where the prompt's KV stays sharded (``seq.cp.keep``) every rank allocates its own pieces' blocks
(compact); a helper then only holds them, and the owner's sequence decodes in steps of its own, one
sequence each (``schedule_sharded``), taking turns with the other steps; it is never preempted (its
KV cannot be recomputed here) and never enters the prefix cache (its blocks are compact).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from afdserve.engine.sequence import Sequence, Status
from afdserve.kvcache.block_manager import BlockManager, PrefixHit
from afdserve.kvcache.prefix import block_hashes


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


@dataclass
class Batch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # tokens of each sequence computed this step
    preempted: list[Sequence] = field(default_factory=list)
    cp: bool = False  # a context-parallel prefill step (its one sequence's part of the prompt)
    sharded: bool = False  # a decode step of one sequence whose prompt KV stays sharded

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager):
        self.cfg, self.blocks = cfg, blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.in_flight: set[int] = set()  # seq_ids in a scheduled step not advanced yet
        self._free_after: list[Sequence] = []  # finished while in flight: blocks freed when the step lands
        self.cp_queue: list[Sequence] = []  # context-parallel prefills to run, by handle
        self.cp_busy: Sequence | None = None  # the one in a step in flight
        self.sharded: list[Sequence] = []  # owned sequences decoding over sharded KV, in turn

    def add(self, seq: Sequence) -> None:
        if seq.cp is not None:
            self.cp_queue.append(seq)
            self.cp_queue.sort(key=lambda s: s.cp.handle)
            return
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.cp_queue or self.cp_busy or self.sharded)

    def schedule_cp(self) -> Batch | None:
        """The next context-parallel prefill's step (the lowest handle), unless one is in flight or
        its owner's blocks are not free yet (the other ranks wait for it meanwhile)."""
        if self.cp_busy is not None or not self.cp_queue:
            return None
        seq = self.cp_queue[0]
        n = seq.num_tokens  # (the owner's blocks: a re-admitted request's outputs too, computed after the prompt)
        if (seq.cp.owner or seq.cp.keep) and seq.seq_id not in self.blocks.tables:
            held = seq.cp.held if seq.cp.keep else n
            if not self.blocks.can_admit(PrefixHit(), held):
                return None
            self.blocks.acquire(seq.seq_id, PrefixHit(), held)
            self.blocks.reserve(seq.seq_id, held)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = 0
        self.cp_queue.pop(0)
        self.cp_busy = seq
        self.in_flight.add(seq.seq_id)
        return Batch([seq], [seq.cp.total - seq.num_computed], cp=True)

    def schedule_sharded(self) -> Batch | None:
        """The decode step of the next sharded sequence not in flight whose new token has a block
        (None: none can run now); it goes to the back of the turn."""
        for i, seq in enumerate(self.sharded):
            if seq.seq_id in self.in_flight:
                continue
            held = seq.cp.held_after(seq.num_computed)  # its tokens here after the step
            if self.blocks.blocks_needed(seq.seq_id, held):
                if not self.blocks.can_hold(seq.seq_id, held):
                    continue
                self.blocks.reserve(seq.seq_id, held)
            self.sharded.append(self.sharded.pop(i))
            self.in_flight.add(seq.seq_id)
            return Batch([seq], [1], sharded=True)
        return None

    def finish(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence and frees its blocks (once no step in flight
        writes them any more)."""
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.cp_queue:
            self.cp_queue.remove(seq)
        elif seq in self.sharded:
            self.sharded.remove(seq)
        if seq.seq_id in self.in_flight:
            self._free_after.append(seq)
        else:
            self.blocks.free(seq.seq_id)

    def _preempt(self, seq: Sequence, batch: Batch) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def schedule(self, lanes: int = 1) -> Batch:
        """The next step's batch. With ``lanes`` > 1 steps in flight at once, it holds no sequence of
        another step in flight, at most about a ``lanes``-th of the running sequences and a
        ``lanes``-th of the token budget; a preemption never takes a sequence in flight."""
        batch = Batch()
        budget = max(1, self.cfg.max_num_batched_tokens // lanes)
        share = -(-len(self.running) // lanes) if lanes > 1 else len(self.running)
        blocks, in_flight, bs = self.blocks, self.in_flight, self.blocks.block_size
        seqs, num_new = batch.seqs, batch.num_new
        # the running sequences as they were, with the blocks each holds: a preemption only takes
        # sequences after the one scheduling (skipped when reached), a reserve only adds to its own
        running = list(self.running)
        for seq, held in zip(running, blocks.held([seq.seq_id for seq in running])):
            if budget <= 0 or len(seqs) >= share:
                break
            if seq.seq_id in in_flight or (batch.preempted and seq in batch.preempted):
                continue
            done = seq.num_computed
            n = min(len(seq.prompt_token_ids) + len(seq.output_token_ids) - done, budget)
            if done + n > held * bs:  # it needs blocks (most decode steps need none)
                while not blocks.can_hold(seq.seq_id, done + n):
                    # the latest arrival not in flight; never one already in this batch
                    victim = next(v for v in reversed(self.running) if v.seq_id not in in_flight)
                    self._preempt(victim, batch)
                    if victim is seq:
                        break
                if seq.status is Status.WAITING:
                    break  # it preempted itself: everything after it not in flight is gone too
                blocks.reserve(seq.seq_id, done + n)
            seqs.append(seq)
            num_new.append(n)
            budget -= n
        # Newly preempted sequences wait for the next step, so they don't take back blocks now.
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if seq in batch.preempted:
                break
            hit = self._lookup(seq)
            n = min(seq.num_tokens - hit.num_blocks * bs, budget)
            if not self.blocks.can_admit(hit, hit.num_blocks * bs + n):
                break
            self.waiting.popleft()
            seq.num_computed = self.blocks.acquire(seq.seq_id, hit, seq.num_tokens)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = seq.num_computed
            # a restore that failed (a lost or invalid file) leaves fewer tokens cached: fit what is free
            room = (len(self.blocks.tables[seq.seq_id]) + self.blocks.num_free) * bs - seq.num_computed
            n = min(seq.num_tokens - seq.num_computed, budget, room)
            if n <= 0:
                self.blocks.free(seq.seq_id)
                seq.num_computed = 0
                self.waiting.appendleft(seq)
                break
            self.blocks.reserve(seq.seq_id, seq.num_computed + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n
        if lanes > 1:
            self.in_flight.update(seq.seq_id for seq in batch.seqs)
        return batch

    def advance(self, batch: Batch) -> None:
        """After a step ran: the batch's tokens are computed; full blocks become cached (the blocks
        full before were registered by the step that filled them, so a step of one token registers
        one only where it fills a block)."""
        caching, bs = self.blocks.enabled, self.blocks.block_size
        for seq, n in zip(batch.seqs, batch.num_new):
            if seq.status is Status.FINISHED:  # aborted while the step was in flight
                continue
            seq.num_computed += n
            if batch.cp:  # the prompt is computed: the owner decodes from now on (a helper holds its shard)
                seq.status = Status.RUNNING
                if seq.cp.owner:
                    (self.sharded if seq.cp.keep else self.running).append(seq)
            if caching and (n > 1 or seq.num_computed % bs == 0) and not (seq.cp is not None and seq.cp.keep):
                self.blocks.commit(seq.seq_id, self._keys(seq), seq.num_computed)
        self.land(batch)

    def land(self, batch: Batch) -> None:
        """The batch's step is over (advanced, or abandoned): its sequences are free to be scheduled,
        those finished meanwhile give their blocks back."""
        if batch.cp:
            seq = self.cp_busy
            self.cp_busy = None
            if seq is not None and seq.status is Status.WAITING:  # not computed: it runs again (its blocks kept)
                self.cp_queue.insert(0, seq)
        if not self.in_flight:
            return
        for seq in batch.seqs:
            self.in_flight.discard(seq.seq_id)
        if self._free_after:
            done = [seq for seq in self._free_after if seq.seq_id not in self.in_flight]
            for seq in done:
                self.blocks.free(seq.seq_id)
            self._free_after = [seq for seq in self._free_after if seq.seq_id in self.in_flight]

    def _keys(self, seq: Sequence) -> list[bytes]:
        """The sequence's chain keys, extended to all its full blocks."""
        bs, have = self.blocks.block_size, len(seq.block_hashes)
        full = seq.num_tokens // bs
        if full > have and self.blocks.salt is not None:
            parent = seq.block_hashes[-1] if have else None
            seq.block_hashes.extend(block_hashes(seq.tokens(have * bs, full * bs), bs, self.blocks.salt, parent))
        return seq.block_hashes

    def _lookup(self, seq: Sequence) -> PrefixHit:
        if not self.blocks.enabled or seq.num_computed:
            return PrefixHit()
        limit = seq.num_tokens - 1  # the last token is computed: its logits sample the next one
        if seq.params.prompt_logprobs is not None:
            limit = min(limit, len(seq.prompt_logprobs))  # positions whose prompt logprobs are known
        return self.blocks.lookup(self._keys(seq), limit // self.blocks.block_size)
