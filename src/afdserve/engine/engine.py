"""The engine core: schedule a batch, run it, sample, apply the token-level stop conditions.

It knows token ids only: tokenization, detokenization, stop strings and output shapes belong to
the front end (``afdserve.engine.frontend``). The same core runs the colocated deployment (a
``ModelRunner`` with local experts) and each attention worker of a disaggregated deployment (a
runner that ships routed tokens to expert workers); only the runner, passed in when the engine is
built, differs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from afdserve.engine.outputs import TokenOutput
from afdserve.engine.runner import Runner
from afdserve.engine.sampler import sample
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.scheduler import Scheduler, SchedulerConfig
from afdserve.engine.sequence import Sequence
from afdserve.errors import RequestError
from afdserve.kvcache.block_manager import BlockManager
from afdserve.model.attention import AttnMetadata


@dataclass
class StepStats:
    num_seqs: int = 0
    num_tokens: int = 0
    num_decode: int = 0
    seconds: float = 0.0


class Engine:
    def __init__(self, runner: Runner, blocks: BlockManager, sched: SchedulerConfig, max_model_len: int,
                 eos_token_ids: set[int]):
        self.runner, self.blocks = runner, blocks
        self.scheduler = Scheduler(sched, blocks)
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.seqs: dict[str, Sequence] = {}
        self.last_step = StepStats()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queues a validated prompt (``afdserve.engine.prompt.validate_prompt``)."""
        if request_id in self.seqs:
            raise RequestError(f"duplicate request id {request_id!r}")
        seq = Sequence(request_id, list(prompt_token_ids), params, arrival=time.monotonic())
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drops a request and frees its KV blocks; False if it is not here (finished already)."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        seq.finish_reason = seq.finish_reason or "abort"
        self.scheduler.finish(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[TokenOutput]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            self.last_step = StepStats()
            return []
        input_ids: list[int] = []
        kv_slots, qlens, rows, sampled = [], [], [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new)):
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
        for seq, n in zip(batch.seqs, batch.num_new):
            seq.num_computed += n
        outs = []
        if sampled:
            tokens = sample(logits, [s.params for s in sampled], [s.generator for s in sampled])
            for seq, tok in zip(sampled, tokens):
                self._append(seq, tok)
                outs.append(TokenOutput(seq.request_id, [tok], seq.finish_reason, seq.stop_reason))
                if seq.finish_reason is not None:
                    self.scheduler.finish(seq)
                    del self.seqs[seq.request_id]
        num_decode = 0 if meta.decode_rows is None else int(meta.decode_rows.shape[0])
        self.last_step = StepStats(len(batch), batch.num_tokens, num_decode, time.perf_counter() - t0)
        return outs

    def _append(self, seq: Sequence, tok: int) -> None:
        seq.output_token_ids.append(tok)
        p = seq.params
        if not p.ignore_eos and tok in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif tok in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", tok
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
