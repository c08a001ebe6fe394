"""The engine core: schedule a batch, run it, sample, apply the token-level stop conditions.

It knows token ids only: tokenization, detokenization, stop strings and output shapes belong to
the front end (``afdserve.engine.frontend``). The same core runs the colocated deployment (a
``ModelRunner`` with local experts) and each attention worker of a disaggregated deployment (a
runner that ships routed tokens to expert workers); only the runner, passed in when the engine is
built, differs.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Protocol

import numpy as np
import torch

from afdserve.backends.step import StepLayout
from afdserve.engine.cp import CPShard, CPStep, compact_slots, cp_layout, extended_rows, sharded_layout
from afdserve.engine.outputs import PrefillProgress, TokenOutput
from afdserve.engine.runner import ModelInput, ModelOutput, Runner
from afdserve.engine.sampler import plain_greedy, rows_logprobs, sample_rows
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.sampling_state import SamplingState
from afdserve.engine.scheduler import Batch, Scheduler, SchedulerConfig
from afdserve.engine.sequence import Sequence, Status
from afdserve.errors import RequestError
from afdserve.kvcache.block_manager import BlockManager
from afdserve.kvcache.prefix import PrefixCacheStats


class Grammars(Protocol):
    """Structured outputs on the engine that samples: one grammar matcher per constrained request."""

    def add(self, seq: Sequence) -> None:
        """Sets ``seq.grammar`` (the request's grammar, compiled once and cached); RequestError if invalid."""

    def mask(self, seqs: list[Sequence]) -> Callable[[torch.Tensor], object] | None:
        """A function setting, in place on the logits' device, the logits [len(seqs), vocab] of the
        tokens each sequence's grammar does not allow next to -inf (rows without a grammar left as
        they are); None when no sequence has a grammar."""

    def accept(self, seq: Sequence, token: int) -> bool:
        """Advances ``seq``'s grammar by ``token``; True when the grammar is complete."""

    def remove(self, seq: Sequence) -> None: ...


@dataclass
class StepInputs:
    """A scheduled step, between ``Engine.begin`` and ``Engine.finish``."""

    batch: Batch
    model_input: ModelInput  # what the runner computes (rows ascending; greedy: token ids, not logits)
    order: np.ndarray | None  # the permutation back to (sampled rows, prompt-logprob rows)
    sampled: list[tuple[Sequence, int]]
    prompt_rows: list[tuple[Sequence, int, int]]
    partial: list[Sequence]
    t0: float


@dataclass
class StepStats:
    num_seqs: int = 0
    num_tokens: int = 0
    num_decode: int = 0
    seconds: float = 0.0


class Engine:
    def __init__(self, runner: Runner, blocks: BlockManager, sched: SchedulerConfig, max_model_len: int,
                 eos_token_ids: set[int], grammars: Grammars | None = None, kv_window: int = 0):
        """``kv_window``: every layer attends to at most this many keys (0: some layer to all); the
        blocks of older tokens go back to the pool as the sequences advance."""
        self.runner, self.blocks = runner, blocks
        self.kv_window = kv_window
        self.scheduler = Scheduler(sched, blocks)
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.seqs: dict[str, Sequence] = {}
        self.last_step = StepStats()
        self.grammars = grammars
        self._reported: set[str] = set()  # requests whose first output (with num_cached_tokens) is out
        self.cp_steps = 0  # context-parallel prefill steps computed here
        self.sharded_steps = 0  # decode steps over sharded KV computed here
        # a helper's shards of sharded prompts (handle -> (slots, positions), int64), read by the CP
        # server's thread (``afdserve.runtime.cp``) under ``shard_lock``
        self.shards: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.shard_lock = threading.Lock()
        self._sharded_turn = False  # sharded decode steps take turns with the others
        # the sampling state of the running sequences that sample (on the logits' device, made by the first
        # sample): a sequence's row lives from its first sampled step until it finishes or is preempted
        self.sampling: SamplingState | None = None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    output_token_ids: list[int] | None = None, cp: CPShard | None = None) -> None:
        """Queues a validated prompt (``afdserve.engine.prompt.validate_prompt``). ``output_token_ids``:
        tokens a request already generated elsewhere (a re-admitted request): recomputed with the
        prompt, then counted as output (max_tokens, penalties, its grammar). ``cp``: this worker's part
        of the prompt's context-parallel prefill (``afdserve.engine.cp``; a helper rank's request
        computes its part and is done, silently, or holds its shard of the prompt's KV)."""
        if request_id in self.seqs:
            raise RequestError(f"duplicate request id {request_id!r}")
        if output_token_ids and params.prompt_logprobs is not None:
            params = replace(params, prompt_logprobs=None)  # reported with the first token already
        if cp is not None:
            try:
                cp.check(len(prompt_token_ids))
            except ValueError as e:
                raise RequestError(str(e)) from None
        seq = Sequence(request_id, list(prompt_token_ids), params, arrival=time.monotonic(),
                       output_token_ids=list(output_token_ids or []), cp=cp)
        if params.structured_outputs is not None and (cp is None or cp.owner):
            if self.grammars is None:
                raise RequestError("structured outputs need the tokenizer on the worker that samples")
            self.grammars.add(seq)  # compiles (cached) or raises RequestError
            for tok in seq.output_token_ids:  # a re-admitted request's grammar is where it was
                self.grammars.accept(seq, tok)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def adopt(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
              output_token_ids: list[int], seq_id: int, num_cached_tokens: int) -> None:
        """Takes over a request whose prompt another worker prefilled (prefill/decode
        disaggregation): its KV is in the blocks ``seq_id`` holds already; it decodes from
        ``output_token_ids`` on. Its first output went out from the prefill worker."""
        if request_id in self.seqs:
            raise RequestError(f"duplicate request id {request_id!r}")
        seq = Sequence(request_id, list(prompt_token_ids), params, arrival=time.monotonic(), seq_id=seq_id,
                       output_token_ids=list(output_token_ids), num_computed=len(prompt_token_ids),
                       status=Status.RUNNING, num_cached_tokens=num_cached_tokens)
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise RequestError("structured outputs need the tokenizer on the worker that samples")
            self.grammars.add(seq)
            for tok in seq.output_token_ids:
                self.grammars.accept(seq, tok)
        self.blocks.commit(seq_id, self.scheduler._keys(seq), seq.num_computed)  # its full blocks are cached
        self.seqs[request_id] = seq
        self._reported.add(request_id)
        self.scheduler.running.append(seq)

    @staticmethod
    def new_seq_id() -> int:
        """A sequence id no sequence of this process holds (blocks reserved before the sequence)."""
        return Sequence("", [], SamplingParams()).seq_id

    def abort(self, request_id: str) -> bool:
        """Drops a request and frees its KV blocks; False if it is not here (finished already)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        seq.finish_reason = seq.finish_reason or "abort"
        self._finish(seq)  # a sequence in a step in flight keeps its blocks until the step lands
        return True

    def prefix_stats(self) -> PrefixCacheStats:
        """Prefix-cache counters and tier usage of this engine's KV cache."""
        return self.blocks.stats()

    def close(self) -> None:
        """At shutdown: writes the cached blocks to the disk tier (if any), for the next start."""
        self.blocks.persist()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[TokenOutput]:
        """One step: ``begin``, the runner's forward, ``finish``."""
        s = self.begin()
        if s is None:
            return []
        return self.finish(s, self.runner.forward(s.model_input))

    def begin(self, lanes: int = 1) -> StepInputs | None:
        """Schedules a batch and prepares its inputs, for a runner to compute. With ``lanes`` > 1 the
        batch is one of that many steps in flight at once (the disaggregated pipeline): it takes
        only sequences not in another step in flight, about a ``lanes``-th of the running ones, within a
        ``lanes``-th of the token budget. None when nothing can run now."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule_cp()  # first: the other ranks of its group wait for it
        if batch is not None:
            return self._begin_cp(batch, t0)
        sched = self.scheduler
        if sched.sharded:  # a sharded sequence's step every other time (or whenever no other runs)
            self._sharded_turn = not self._sharded_turn
            if self._sharded_turn and (batch := sched.schedule_sharded()) is not None:
                return self._begin_sharded(batch, t0)
        batch = sched.schedule(lanes)
        if batch.preempted and self.sampling is not None:  # they join again when they next sample
            for seq in batch.preempted:
                self.sampling.remove(seq)
        if not batch:
            if sched.sharded and (batch := sched.schedule_sharded()) is not None:
                return self._begin_sharded(batch, t0)
            if lanes == 1:
                self.last_step = StepStats()
            return None
        input_ids: list[int] = []
        seq_ids, kv_lens, sampled, prompt_rows, partial = [], [], [], [], []
        for seq, n in zip(batch.seqs, batch.num_new):
            start = seq.num_computed
            total = start + n
            seq_ids.append(seq.seq_id)
            kv_lens.append(total)
            out = seq.output_token_ids
            if n == 1 and total == len(seq.prompt_token_ids) + len(out):  # a decode (past any prompt logprob)
                sampled.append((seq, len(input_ids)))
                input_ids.append(out[-1] if out else seq.prompt_token_ids[-1])
                continue
            first_row = len(input_ids)
            input_ids.extend(seq.tokens(start, total))
            if seq.params.prompt_logprobs is not None:  # row r predicts prompt token r + 1
                done = len(seq.prompt_logprobs)  # positions already computed (before a preemption)
                for pos in range(max(start, done), min(total, len(seq.prompt_token_ids) - 1)):
                    prompt_rows.append((seq, first_row + pos - start, pos + 1))
            if total == seq.num_tokens:  # all its tokens computed after this step: it samples one
                sampled.append((seq, len(input_ids) - 1))
            else:  # a chunk of a longer prefill: reported as progress
                partial.append(seq)
        rows = np.array([r for _, r in sampled] + [r for _, r, _ in prompt_rows], dtype=np.int64)
        order = np.argsort(rows, kind="stable") if prompt_rows else None  # runners return rows ascending
        layout = StepLayout.of(batch.num_new, kv_lens, self.blocks.batch_table(seq_ids), self.blocks.block_size)
        greedy = bool(sampled) and not prompt_rows and all(plain_greedy(seq) for seq, _ in sampled)
        inp = ModelInput(np.array(input_ids, dtype=np.int64), layout, rows if order is None else rows[order], greedy)
        return StepInputs(batch, inp, order, sampled, prompt_rows, partial, t0)

    def _begin_cp(self, batch, t0: float) -> StepInputs:
        """A context-parallel prefill step: this rank's pieces of the prompt (``afdserve.engine.cp``).
        The owner samples the prompt's last row and reads prompt logprobs from the extended rows."""
        seq = batch.seqs[0]
        shard: CPShard = seq.cp
        table = self.blocks.block_table(seq.seq_id) if shard.owner or shard.keep else []
        layout, slots = cp_layout(shard, table, self.blocks.block_size)
        pos = shard.positions()
        ids = np.asarray(seq.prompt_token_ids, dtype=np.int64)[pos]
        hidden = seq.params.prompt_logprobs is not None
        sampled, prompt_rows = [], []
        n = len(seq.prompt_token_ids)
        if shard.owner and not seq.output_token_ids:  # (a re-admitted request's outputs are computed after it)
            sampled.append((seq, int(np.flatnonzero(pos == n - 1)[0])))
            if hidden:
                row_of = np.empty(n, dtype=np.int64)
                ext = extended_rows(shard)
                row_of[ext] = np.arange(ext.shape[0])
                prompt_rows = [(seq, int(row_of[p]), p + 1) for p in range(n - 1)]
        rows = np.array([r for _, r in sampled] + [r for _, r, _ in prompt_rows], dtype=np.int64)
        order = np.argsort(rows, kind="stable") if prompt_rows else None
        greedy = bool(sampled) and not prompt_rows and plain_greedy(seq)
        inp = ModelInput(ids, layout, rows if order is None else rows[order], greedy, CPStep(shard, slots, hidden))
        return StepInputs(batch, inp, order, sampled, prompt_rows, [], t0)

    def _begin_sharded(self, batch, t0: float) -> StepInputs:
        """A decode step of a sequence whose prompt KV stays sharded (``afdserve.engine.cp``): its
        new token at its true position, written after the owner's own tokens (compact)."""
        seq = batch.seqs[0]
        pos = seq.num_computed
        layout, sharded = sharded_layout(seq.cp, self.blocks.block_table(seq.seq_id), pos, self.blocks.block_size)
        ids = np.asarray(seq.tokens(pos, pos + 1), dtype=np.int64)
        if pos < seq.num_tokens - 1:  # a token a re-admitted request delivered before: computed, not sampled
            return StepInputs(batch, ModelInput(ids, layout, np.zeros(0, dtype=np.int64), sharded=sharded), None,
                              [], [], [], t0)
        inp = ModelInput(ids, layout, np.zeros(1, dtype=np.int64), plain_greedy(seq), sharded=sharded)
        return StepInputs(batch, inp, None, [(seq, 0)], [], [], t0)

    def finish(self, s: StepInputs, out: ModelOutput) -> list[TokenOutput]:
        """The step ``s`` was computed (the logits of its rows, or for a greedy step the token ids
        they choose): advances its sequences, samples, applies the stop conditions; returns the
        outputs."""
        batch, sampled, prompt_rows = s.batch, s.sampled, s.prompt_rows
        self.cp_steps += batch.cp
        self.sharded_steps += batch.sharded
        if batch.cp and not batch.seqs[0].cp.owner:  # a helper's part is done: nothing to report
            seq = batch.seqs[0]
            if seq.cp.keep and not seq.finished:  # it holds its shard for the owner's decode steps
                table = self.blocks.block_table(seq.seq_id)
                with self.shard_lock:
                    self.shards[seq.cp.handle] = (compact_slots(table, seq.cp.held, self.blocks.block_size),
                                                  seq.cp.positions())
            elif not seq.finished:
                self._finish(seq)
            self.scheduler.advance(batch)
            self.last_step = StepStats(1, s.model_input.layout.num_tokens, 0, time.perf_counter() - s.t0)
            return []
        chosen = out.token_ids is not None
        logits = out.token_ids if chosen else out.logits
        if s.order is not None:
            order = torch.from_numpy(s.order).to(logits.device)
            logits = torch.empty_like(logits).index_copy_(0, order, logits)
        self.scheduler.advance(batch)  # num_computed; full blocks become cached; no longer in flight
        if self.kv_window:  # the next token (position num_computed) attends from here on (a sharded
            for seq in batch.seqs:  # sequence's blocks are compact: all kept)
                if seq.cp is None or not seq.cp.keep:
                    self.blocks.release_before(seq.seq_id, seq.num_computed - self.kv_window + 1)
        if prompt_rows:
            lp = torch.log_softmax(logits[len(sampled):], dim=-1)
            tokens = torch.tensor([seq.prompt_token_ids[pos] for seq, _, pos in prompt_rows], device=lp.device)
            ks = [seq.params.prompt_logprobs or 0 for seq, _, _ in prompt_rows]
            for (seq, _, _), row in zip(prompt_rows, rows_logprobs(lp, tokens, ks)):
                seq.prompt_logprobs.append(row)
        outs = [TokenOutput(seq.request_id, [], num_cached_tokens=self._first_output(seq),
                            prefill=PrefillProgress(seq.num_computed, seq.num_tokens))
                for seq in s.partial if not seq.finished]
        live = [seq for seq, _ in sampled if not seq.finished]  # (not aborted while in flight)
        if live and len(live) == len(sampled):
            outs += self._sample(logits[: len(sampled)], live, chosen=chosen)
        elif live:
            keep = [i for i, (seq, _) in enumerate(sampled) if not seq.finished]
            outs += self._sample(logits[keep], live, chosen=chosen)
        num_decode = s.model_input.layout.num_decode
        self.last_step = StepStats(len(batch), batch.num_tokens, num_decode, time.perf_counter() - s.t0)
        if batch.num_tokens > num_decode:  # measured prefill rate: restore-versus-recompute decisions
            self.blocks.observe_prefill(batch.num_tokens - num_decode, self.last_step.seconds)
        return outs

    def cancel(self, s: StepInputs) -> None:
        """The step ``s`` will not be computed (a peer was lost mid-step): its sequences are as before
        it and run again in a later step."""
        self.scheduler.land(s.batch)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], chosen: bool = False) -> list[TokenOutput]:
        if chosen:  # token ids the runner chose (a greedy step): plain rows, whose sampling state (if they
            # have a row) never reads its counts (no penalty) nor its length (min_tokens reached)
            tokens, logprobs = logits.tolist(), [None] * len(seqs)
        else:
            state = self.sampling
            if state is None:
                state = self.sampling = SamplingState(logits.shape[1], logits.device, self.eos_token_ids)
            for seq in seqs:
                if seq not in state:
                    state.add(seq, seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.generator)
            mask = self.grammars.mask(seqs) if self.grammars is not None else None
            tokens, logprobs = sample_rows(logits, state, state.index(seqs), mask)
        outs = []
        reported = self._reported
        for seq, tok, lp in zip(seqs, tokens, logprobs):
            first = not seq.output_token_ids
            self._append(seq, tok)
            rid = seq.request_id
            outs.append(TokenOutput(rid, [tok], seq.finish_reason, seq.stop_reason,
                                    logprobs=None if lp is None else [lp],
                                    prompt_logprobs=seq.prompt_logprobs if first and seq.params.prompt_logprobs
                                    is not None else None,
                                    num_cached_tokens=None if rid in reported else self._first_output(seq)))
            if seq.finish_reason is not None:
                self._finish(seq)
        return outs

    def _first_output(self, seq: Sequence) -> int | None:
        """``seq.num_cached_tokens`` on the request's first output, else None."""
        if seq.request_id in self._reported:
            return None
        self._reported.add(seq.request_id)
        return seq.num_cached_tokens

    def _finish(self, seq: Sequence) -> None:
        if seq.cp is not None and seq.cp.keep and not seq.cp.owner:
            with self.shard_lock:  # no CP server thread reads its blocks from now on
                self.shards.pop(seq.cp.handle, None)
        self.scheduler.finish(seq)
        if self.sampling is not None:
            self.sampling.remove(seq)
        del self.seqs[seq.request_id]
        self._reported.discard(seq.request_id)
        if self.grammars is not None and seq.grammar is not None:
            self.grammars.remove(seq)

    def _append(self, seq: Sequence, tok: int) -> None:
        out = seq.output_token_ids
        out.append(tok)
        p = seq.params
        if seq.grammar is not None and self.grammars is not None and self.grammars.accept(seq, tok):
            seq.finish_reason = "stop"  # the grammar is complete (or cannot go on)
        elif not p.ignore_eos and tok in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif tok in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", tok
        elif len(out) >= p.max_tokens or len(seq.prompt_token_ids) + len(out) >= self.max_model_len:
            seq.finish_reason = "length"
