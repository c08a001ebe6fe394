"""The engine loop: schedule a batch, run it, sample, apply stop conditions, report outputs.

The same loop runs the colocated deployment (``ModelRunner`` with local experts) and each
attention worker of a disaggregated deployment (a runner that ships routed tokens to expert
workers); only the runner differs.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from afdserve.engine.detokenizer import IncrementalDetokenizer
from afdserve.engine.outputs import CompletionOutput, RequestOutput
from afdserve.engine.runner import Runner
from afdserve.engine.sampler import sample
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.scheduler import Batch, Scheduler, SchedulerConfig
from afdserve.engine.sequence import Sequence
from afdserve.engine.tokenizer import TokenizerInfo
from afdserve.errors import RequestError
from afdserve.kvcache.block_manager import BlockManager
from afdserve.model.attention import AttnMetadata


def validate_prompt(prompt: str | dict | list[int], tok: TokenizerInfo | None, vocab: int,
                    max_model_len: int) -> tuple[str | None, list[int]]:
    """Checks a prompt and returns (text, token ids); raises RequestError naming the problem."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt:
            raise RequestError("a dict prompt needs 'prompt_token_ids'")
        text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
    elif isinstance(prompt, str):
        if not prompt:
            raise RequestError("empty prompt")
        if tok is None:
            raise RequestError("this engine has no tokenizer: pass {'prompt_token_ids': [...]}")
        text, ids = prompt, tok.encode(prompt)
    elif isinstance(prompt, list):
        text, ids = None, prompt
    else:
        raise RequestError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
    ids = list(ids)
    if not ids:
        raise RequestError("empty prompt")
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
        raise RequestError(f"prompt token ids must be integers in [0, {vocab})")
    if len(ids) >= max_model_len:
        raise RequestError(
            f"prompt has {len(ids)} tokens; the model's context is {max_model_len} tokens "
            f"(prompt + at least one generated token must fit)"
        )
    return text, ids


@dataclass
class StepStats:
    num_seqs: int = 0
    num_tokens: int = 0
    num_decode: int = 0
    seconds: float = 0.0


class Engine:
    def __init__(self, runner: Runner, blocks: BlockManager, tokenizer: TokenizerInfo | None,
                 sched: SchedulerConfig, max_model_len: int, eos_token_ids: set[int]):
        self.runner, self.blocks, self.tok = runner, blocks, tokenizer
        self.scheduler = Scheduler(sched, blocks)
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.seqs: dict[str, Sequence] = {}
        self.last_step = StepStats()
        self._ids = itertools.count()

    # ---- requests -----------------------------------------------------------------------
    def tokenize(self, prompt: str | dict | list[int]) -> tuple[str | None, list[int]]:
        return validate_prompt(prompt, self.tok, self.runner.vocab_size, self.max_model_len)

    def add_request(self, prompt: str | dict | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        text, ids = self.tokenize(prompt)
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.seqs:
            raise RequestError(f"duplicate request id {rid!r}")
        seq = Sequence(rid, text, ids, params, IncrementalDetokenizer(self.tok.tokenizer if self.tok else None, ids),
                       arrival=time.monotonic())
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        seq.finish_reason = seq.finish_reason or "abort"
        self.scheduler.finish(seq)
        return self._output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            self.last_step = StepStats()
            return []
        order = range(len(batch))
        input_ids: list[int] = []
        kv_slots, qlens, rows, sampled = [], [], [], []
        for i in order:
            seq, n = batch.seqs[i], batch.num_new[i]
            total = seq.num_computed + n
            input_ids.extend(seq.tokens(seq.num_computed, total))
            kv_slots.append(self.blocks.slots(seq.seq_id, total))
            qlens.append(n)
            if batch.samples(i):
                rows.append(len(input_ids) - 1)
                sampled.append(seq)
        meta = AttnMetadata.build(qlens, kv_slots)
        logits = self.runner.forward(torch.tensor(input_ids, dtype=torch.int64), meta,
                                     torch.tensor(rows, dtype=torch.int64))
        for i in order:
            batch.seqs[i].num_computed += batch.num_new[i]
        outs = []
        if sampled:
            tokens = sample(logits, [s.params for s in sampled], [s.generator for s in sampled])
            for seq, tok in zip(sampled, tokens):
                self._append(seq, tok)
                outs.append(self._output(seq))
                if seq.finish_reason is not None:
                    self.scheduler.finish(seq)
                    del self.seqs[seq.request_id]
        num_decode = 0 if meta.decode_rows is None else int(meta.decode_rows.shape[0])
        self.last_step = StepStats(len(batch), batch.num_tokens, num_decode, time.perf_counter() - t0)
        return outs

    def _append(self, seq: Sequence, tok: int) -> None:
        seq.output_token_ids.append(tok)
        new = seq.detok.step(tok)
        seq.text += new
        p = seq.params
        if not p.ignore_eos and tok in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif tok in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", tok
        elif p.stop and new:
            window = len(new) + max(len(s) for s in p.stop)
            tail_start = max(0, len(seq.text) - window)
            hits = [(seq.text.find(s, tail_start), s) for s in p.stop]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, s = min(hits)
                seq.text = seq.text[:pos]
                seq.finish_reason, seq.stop_reason = "stop", s
        if seq.finish_reason is None and (len(seq.output_token_ids) >= p.max_tokens
                                          or seq.num_tokens >= self.max_model_len):
            seq.finish_reason = "length"

    @staticmethod
    def _output(seq: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
            outputs=[CompletionOutput(0, seq.text, list(seq.output_token_ids), seq.finish_reason, seq.stop_reason)],
            finished=seq.finish_reason is not None,
        )
