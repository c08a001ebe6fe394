"""An LM head shared out in pieces between the attention worker whose lane's step it is and the
expert workers: each side takes blocks of the vocabulary (``BLOCK`` rows of the packed weight)
piece by piece, the attention worker from the bottom, expert workers from the top, and the expert
workers only while no layer waits for them.

Where the workers share a core board (one machine, ``lend_idle_cores``) and the kernels run, the
blocks not taken yet are one word of shared memory per lane (``SharedRange``; compare-and-swap in
``kernels/csrc/claims.cpp``): the two ends meet wherever the work went, so neither side waits for a
share the other has not reached (work stealing). Elsewhere each side takes from a range fixed when
the job starts (``FixedRange``; the expert workers' shares from ``LMHeadShare``). A job's tag keeps
an expert worker from taking blocks of a newer job of the same lane for an older job's hidden
states.

An expert worker replies with *runs*: the logits of adjacent blocks it took one after the other,
sent when it stops (a layer came, the job ran out, the reply slot is full); the attention worker
copies each into the step's logits and is done once every vocabulary row is covered. A *greedy* job
(a step whose rows all take the argmax of their logits) computes no logits: each side keeps every
row's largest logit and its index over the blocks it took (``afdserve.model.greedy.Best``), and a
run's reply is those two numbers per row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Set as AbstractSet
from dataclasses import dataclass

import torch

from afdserve import kernels
from afdserve.model.greedy import Best
from afdserve.runtime.core_board import CLAIM_LANES, SLOTS, Lender

BLOCK = 32  # vocabulary rows per block: the packed LM head's column blocks
# an expert worker busy with another lane's layer gets a share of a lane's LM head only while a
# layer's round trip is at most this fraction of that LM head's time here: the share then waits
# little behind the layer, and the LM head ends sooner; behind a long layer it would hold both
# sides up (this worker waits for the share, the expert for the other lane's next layer)
BUSY_SHARE_MAX_WAIT = 1.0
# an expert worker's pieces are this many times smaller than the attention worker's: a layer that
# comes meanwhile waits at most one piece
EXPERT_PIECE_DIVISOR = 2


@dataclass(frozen=True)
class LMJob:
    """An LM head job as an expert worker gets it (the ints of the message that carries the
    normalized hidden states): take blocks of ``[lo, hi)`` ``piece`` at a time from the top, from the
    shared word of (the sender, ``lane``) if ``shared``, else from that range alone; if ``greedy``,
    reply with each row's best logit and its index instead of the logits."""

    tag: int
    piece: int
    lo: int
    hi: int
    shared: bool
    greedy: bool = False

    def ints(self) -> tuple[int, ...]:
        return self.tag, self.piece, self.lo, self.hi, int(self.shared), int(self.greedy)

    @classmethod
    def of(cls, ints: tuple[int, ...]) -> "LMJob":
        tag, piece, lo, hi, shared, greedy = ints[:6]
        return cls(tag, piece, lo, hi, bool(shared), bool(greedy))


class FixedRange:
    """Blocks ``[lo, hi)`` that only one side takes."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi

    def take(self, top: bool, n: int) -> tuple[int, int] | None:
        if self.lo >= self.hi:
            return None
        if top:
            a, b = max(self.lo, self.hi - n), self.hi
            self.hi = a
        else:
            a, b = self.lo, min(self.hi, self.lo + n)
            self.lo = b
        return a, b


class SharedRange:
    """The blocks of job ``tag`` not taken yet, in a claim word both sides take from."""

    def __init__(self, words: torch.Tensor, index: int, tag: int):
        self.words, self.index, self.tag = words, index, tag

    def take(self, top: bool, n: int) -> tuple[int, int] | None:
        got = int(kernels.ops().claims_take(self.words, self.index, self.tag, top, n))
        return None if got < 0 else (got >> 32, got & 0xFFFFFFFF)


class ClaimWords:
    """The claim words of a core board: one per (attention worker, lane)."""

    def __init__(self, words: torch.Tensor):
        self.words = words.view(-1)

    @staticmethod
    def of(lender: Lender | None) -> "ClaimWords | None":
        """The claim words of the board ``lender`` is on; None without a board or kernels."""
        board = getattr(lender, "board", None)
        return ClaimWords(board.claim_words) if board is not None and kernels.available() else None

    @staticmethod
    def index(worker: int, lane: int) -> int:
        """The word of attention worker ``worker``'s ``lane`` (-1: none, past the board)."""
        return worker * CLAIM_LANES + lane if 0 <= worker < SLOTS // 2 and 0 <= lane < CLAIM_LANES else -1

    def open(self, worker: int, lane: int, tag: int, blocks: int) -> SharedRange:
        """A new job of ``blocks`` blocks on the word of (``worker``, ``lane``)."""
        r = self.range(worker, lane, tag)
        kernels.ops().claims_open(self.words, r.index, r.tag, blocks)
        return r

    def range(self, worker: int, lane: int, tag: int) -> SharedRange:
        return SharedRange(self.words, self.index(worker, lane), tag & 0xFFFF)


class Coverage:
    """Vocabulary rows of a job's logits written so far (by either side)."""

    def __init__(self, vocab: int):
        self.vocab, self.rows = vocab, 0

    def add(self, a: int, b: int) -> None:
        self.rows += b - a

    @property
    def done(self) -> bool:
        return self.rows >= self.vocab


class ExpertLMWork:
    """An expert worker's open LM head jobs, worked on while no layer waits for it: blocks taken from
    the top, their logits computed into a run buffer (a greedy job: the run's ``Best``) and sent as one
    reply per run."""

    @dataclass
    class Open:
        sender: int
        meta: tuple[int, int, int, int]  # (step, lane, layer, 0) of the replies
        job: LMJob
        xn: torch.Tensor
        take: Callable[[bool, int], tuple[int, int] | None]
        buf: torch.Tensor | None  # the run's logits, its last block at the right end (a greedy job: none)
        best: Best | None = None  # a greedy job's run
        run: tuple[int, int] | None = None  # the blocks in the buffer

    def __init__(self, logits: Callable[[torch.Tensor, int, int, torch.Tensor], None], vocab: int,
                 claims: ClaimWords | None, capacity: Callable[[int], int],
                 greedy: Callable[[torch.Tensor, int, int, Best], None] | None = None):
        """``logits(xn, start, end, out)``: the logits of vocabulary ``[start, end)`` into ``out``;
        ``greedy(xn, start, end, best)``: each row's best of them and its index merged into ``best``
        (greedy jobs)."""
        self.logits, self.vocab, self.claims, self.capacity, self.greedy = logits, vocab, claims, capacity, greedy
        self.jobs: list[ExpertLMWork.Open] = []

    def add(self, sender: int, step: int, lane: int, layer: int, ints: tuple[int, ...], xn: torch.Tensor) -> None:
        job = LMJob.of(ints)
        if job.shared and self.claims is not None:
            take = self.claims.range(sender, lane, job.tag).take
        else:
            take = FixedRange(job.lo, job.hi).take
        rows, buf = xn.shape[0], None
        if job.greedy and self.greedy is None:
            raise RuntimeError("a greedy LM head job came to an expert worker that cannot compute one")
        if not job.greedy:  # a greedy run's reply is two numbers a row: no buffer
            # a reply slot's worth
            blocks = min(self.capacity(sender) // max(1, rows * 4 * BLOCK), -(-self.vocab // BLOCK))
            if blocks < 1:
                raise RuntimeError(f"an LM head job of {rows} rows does not fit the reply slots of {sender}")
            buf = torch.empty(rows, blocks * BLOCK, dtype=torch.float32, device=xn.device)
        self.jobs.append(self.Open(sender, (step, lane, layer, 0), job, xn.clone(), take, buf))

    def clear(self) -> None:
        self.jobs.clear()

    def work(self, interrupted: Callable[[], bool],
             send: Callable[[int, list[torch.Tensor], tuple, int, int], None]) -> None:
        """Works on the oldest job, piece by piece, until ``interrupted()`` (a message came) or no
        blocks are left (the job is dropped); each run goes out through ``send(sender, tensors, meta,
        start row, end row)``: [logits], or a greedy job's [values, indices]."""
        o = self.jobs[0]
        width = -(-self.vocab // BLOCK) if o.job.greedy else o.buf.shape[1] // BLOCK  # type: ignore[union-attr]
        while True:
            got = o.take(True, min(max(1, o.job.piece // EXPERT_PIECE_DIVISOR), width))
            if got is None:
                self._flush(o, send)
                self.jobs.pop(0)
                return
            a, b = got
            if o.run is not None and (o.run[0] != b or o.run[1] - a > width):  # not adjacent, or full
                self._flush(o, send)
            hi = b if o.run is None else o.run[1]
            start, end = a * BLOCK, min(b * BLOCK, self.vocab)
            if o.job.greedy:
                o.best = o.best or Best(o.xn.shape[0], o.xn.device)
                self.greedy(o.xn, start, end, o.best)  # type: ignore[misc]
            else:
                self.logits(o.xn, start, end, self._columns(o.buf, a, b, hi))  # type: ignore[arg-type]
            o.run = (a, hi)
            if interrupted():
                self._flush(o, send)
                return

    def _flush(self, o: "ExpertLMWork.Open", send: Callable[..., None]) -> None:
        if o.run is None:
            return
        a, b = o.run
        if o.job.greedy:
            tensors, o.best = [o.best.val, o.best.idx], None  # type: ignore[union-attr]
        else:
            tensors = [self._columns(o.buf, a, b, b)]  # type: ignore[arg-type]
        send(o.sender, tensors, o.meta, a * BLOCK, min(b * BLOCK, self.vocab))
        o.run = None

    def _columns(self, buf: torch.Tensor, a: int, b: int, hi: int) -> torch.Tensor:
        """The columns of ``buf`` holding blocks ``[a, b)`` of a run that ends at block ``hi`` (the
        buffer's right end stands for vocabulary row ``hi * BLOCK``; rows past the vocabulary have
        no columns)."""
        end = min(b * BLOCK, self.vocab)
        right = buf.shape[1] - (hi * BLOCK - end)
        return buf[:, right - (end - a * BLOCK): right]


class LMHeadShare:
    """How much of the LM head's vocabulary an attention worker sends to the expert workers: a share
    in [0, ``limit``] moved, about every ``WINDOW_S``, toward balancing this worker's busy fraction
    (the time it did not wait for replies) against the busiest expert worker's (reported with every
    reply). A share must fit the reply slots: ``reply_bytes`` per float32 reply."""

    WINDOW_S = 0.05
    GAIN = 0.5

    def __init__(self, limit: float, reply_bytes: int):
        self.limit, self.reply_bytes = limit, reply_bytes
        self.share = limit  # starts at the limit; the balance moves it
        self._t0 = time.perf_counter_ns()
        self._waited = 0
        self._busy: dict[int, int] = {}  # per expert worker: busy microseconds it reported last
        self._busy0: dict[int, int] = {}  # ... at the window's start

    def shares(self, rows: int, vocab: int, workers: list[int],
               busy: AbstractSet[int] = frozenset()) -> list[tuple[int, int, int]]:
        """``(worker, start, end)`` of the vocabulary each expert worker computes for ``rows`` rows
        (ascending; this worker computes ``[0, first start)``); [] for none. Workers in ``busy`` (with
        another lane's dispatch in flight) get none: such a worker would start its share only after
        that layer, and both sides would wait, this worker for the share and that one for the other
        lane's next layer (which this worker computes only once the share is in)."""
        workers = [j for j in workers if j not in busy]
        if self.share <= 0 or not workers or rows == 0:
            return []
        remote = min(int(vocab * self.share), self.reply_bytes // (rows * 4) * len(workers))
        start = -(-(vocab - remote) // 32) * 32  # whole blocks of 32 of the packed weight
        if start >= vocab:
            return []
        cuts = [start + (vocab - start) * i // len(workers) // 32 * 32 for i in range(len(workers))] + [vocab]
        return [(j, cuts[i], cuts[i + 1]) for i, j in enumerate(workers) if cuts[i + 1] > cuts[i]]

    def waited(self, ns: int) -> None:
        self._waited += ns

    def expert_busy(self, worker: int, busy_us: int) -> None:
        self._busy[worker] = busy_us
        self._busy0.setdefault(worker, busy_us)

    def step_done(self) -> None:
        """A step's logits are done: at the end of a window, move the share."""
        now = time.perf_counter_ns()
        wall = now - self._t0
        if wall < self.WINDOW_S * 1e9:
            return
        if self.limit > 0 and self._busy:
            mine = 1.0 - self._waited / wall
            theirs = max(min(1.0, (self._busy[j] - self._busy0[j]) * 1e3 / wall) for j in self._busy)
            self.share = min(self.limit, max(0.0, self.share + self.GAIN * (mine - theirs)))
        self._t0, self._waited = now, 0
        self._busy0 = dict(self._busy)


def unshared_busy(busy: set[int], lm_work: int, lm_rate: float, layer_rtt: float) -> set[int]:
    """Of the expert workers ``busy`` with another lane's layer, those that get no share of an LM
    head of ``lm_work`` (token rows x vocabulary rows, computed here at ``lm_rate`` per second): all
    of them, unless a layer's round trip ``layer_rtt`` (seconds) is at most ``BUSY_SHARE_MAX_WAIT``
    of that LM head's time (none measured yet: all of them)."""
    if busy and lm_rate > 0 and 0 < layer_rtt <= BUSY_SHARE_MAX_WAIT * lm_work / lm_rate:
        return set()
    return busy


