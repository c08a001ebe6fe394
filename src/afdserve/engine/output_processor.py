"""The front end's half of a request's output: token ids in, text and vLLM-shaped outputs out.

The engine core (or an attention worker) reports new token ids, their log-probabilities when asked
for, and finish events. Here each request's tokens are detokenized incrementally, stop strings are
matched (a hit finishes the sequence, and the caller aborts it in the engine, as vLLM's front end
does), log-probabilities get their token strings, the ``n`` sequences of a request (each its own
engine request) are gathered into one output, and the cumulative ``RequestOutput`` is built once per
step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from afdserve.engine.detokenizer import IncrementalDetokenizer, extend_all
from afdserve.engine.outputs import (CompletionOutput, Logprob, PositionLogprobs, PrefillProgress, RequestOutput,
                                     TokenLogprobs, TokenOutput)
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.tokenizer import TokenizerInfo


@dataclass
class _Sequence:
    """One of a request's ``n`` sequences."""

    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    pending: list[int] = field(default_factory=list)  # tokens not detokenized yet (a deferred request's)

    def output(self, index: int) -> CompletionOutput:
        return CompletionOutput(index, self.text, list(self.token_ids), self.finish_reason, self.stop_reason,
                                None if self.logprobs is None else list(self.logprobs), self.cumulative_logprob)


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    stop: list[str]
    seqs: list[_Sequence]
    engine_ids: list[str]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error: str | None = None
    num_cached_tokens: int | None = None
    prefill: PrefillProgress | None = None
    final_only: bool = False  # one output, when it finishes (SamplingParams.output_kind)

    @property
    def deferred(self) -> bool:
        """Its text is read only when it finishes and no stop string reads it before: detokenized
        then, at once (``_flush``), not token by token."""
        return self.final_only and not self.stop

    def progress(self, o: TokenOutput) -> None:
        """Takes in the prefill's progress: the first report of cached tokens, and positions done,
        never going back (a preempted or re-admitted request recomputes), complete with a token."""
        if o.num_cached_tokens is not None and self.num_cached_tokens is None:
            self.num_cached_tokens = o.num_cached_tokens
        p = o.prefill
        if p is None and self.prefill is not None and self.prefill.done == self.prefill.total:
            return  # complete already (a decode step's token, the common case)
        if p is None and o.new_token_ids:  # a token: the prefill is complete
            total = self.prefill.total if self.prefill is not None else len(self.prompt_token_ids)
            p = PrefillProgress(total, total)
        if p is not None and (self.prefill is None or p.done > self.prefill.done):
            self.prefill = PrefillProgress(min(p.done, p.total), p.total)

    @property
    def finished(self) -> bool:
        if len(self.seqs) == 1:
            return self.seqs[0].finish_reason is not None
        return all(s.finish_reason is not None for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer: TokenizerInfo | None):
        self.tokenizer = tokenizer.tokenizer if tokenizer is not None else None
        self.live: dict[str, _Request] = {}
        self._seq_of: dict[str, tuple[str, int]] = {}  # engine request id -> (request id, sequence index)

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams) -> list[tuple[str, SamplingParams]]:
        """Registers a request; returns the engine requests that run it: ``(id, params)``, one per
        sequence (``n`` of them; with a seed, sequence i samples with ``seed + i``, as vLLM does)."""
        if params.n == 1:
            engine = [(request_id, params)]
        else:
            engine = [(f"{request_id}#{i}",
                       replace(params, n=1, seed=None if params.seed is None else (params.seed + i) % 2**64))
                      for i in range(params.n)]
        seqs = [_Sequence(IncrementalDetokenizer(self.tokenizer, prompt_token_ids),
                          logprobs=[] if params.logprobs is not None else None,
                          cumulative_logprob=0.0 if params.logprobs is not None else None) for _ in engine]
        self.live[request_id] = _Request(prompt, prompt_token_ids, list(params.stop or []), seqs, [e for e, _ in engine],
                                         final_only=params.output_kind == "final_only")
        for i, (eid, _) in enumerate(engine):
            self._seq_of[eid] = (request_id, i)
        return engine

    def tokens_so_far(self, engine_id: str) -> list[int]:
        """The tokens an engine request has produced and this front end has taken in."""
        rid, index = self._seq_of[engine_id]
        return list(self.live[rid].seqs[index].token_ids)

    def is_taken(self, request_id: str) -> bool:
        return request_id in self.live or request_id in self._seq_of

    def drop(self, request_id: str) -> list[str]:
        """Forgets a request; returns its engine requests that were still running."""
        r = self.live.pop(request_id, None)
        if r is None:
            return []
        for eid in r.engine_ids:
            del self._seq_of[eid]
        return [eid for eid, s in zip(r.engine_ids, r.seqs) if s.finish_reason is None]

    def process(self, outs: list[TokenOutput]) -> tuple[list[RequestOutput], list[str]]:
        """The outputs of the requests that progressed (one each, the latest) and the engine
        requests a stop string finished, which the engine must abort. Tokens of requests that are
        no longer live (finished or aborted meanwhile) are dropped."""
        changed: dict[str, _Request] = {}
        stopped: list[str] = []
        for o in outs:
            where = self._seq_of.get(o.request_id)
            if where is None:
                continue
            rid, index = where
            r = self.live[rid]
            s = r.seqs[index]
            if s.finish_reason is not None:
                continue  # a stop string finished it; the abort is on its way
            changed[rid] = r
            r.progress(o)
            if o.prompt_logprobs is not None and r.prompt_logprobs is None:
                r.prompt_logprobs = [None] + [self._position(lp) for lp in o.prompt_logprobs]
            if self._extend(r, s, o):
                stopped.append(o.request_id)
            if o.error is not None and r.error is None:
                r.error = o.error
        # building an output per step is most of this loop's cost: a final-only request's only at its end
        changed = {rid: r for rid, r in changed.items() if not r.final_only or r.finished or r.error is not None}
        _flush([s for r in changed.values() for s in r.seqs if s.pending])
        outputs = []
        for rid, r in changed.items():
            finished = r.finished
            outputs.append(RequestOutput(rid, r.prompt, r.prompt_token_ids, [s.output(i) for i, s in enumerate(r.seqs)],
                                         finished=finished, error=r.error, prompt_logprobs=r.prompt_logprobs,
                                         num_cached_tokens=r.num_cached_tokens, prefill=r.prefill))
            if finished:
                self.drop(rid)
        return outputs, stopped

    def _extend(self, r: _Request, s: _Sequence, o: TokenOutput) -> bool:
        """Adds ``o``'s tokens to ``s``; True when a stop string finished it before the engine did."""
        finish, stop_reason = o.finish_reason, o.stop_reason
        if r.deferred:
            s.token_ids += o.new_token_ids
            s.pending += o.new_token_ids
            if s.logprobs is not None and o.logprobs is not None:
                for lp in o.logprobs:
                    s.logprobs.append(self._position(lp))
                    s.cumulative_logprob = (s.cumulative_logprob or 0.0) + lp.logprob
            s.finish_reason, s.stop_reason = finish, stop_reason
            return False
        for i, tok in enumerate(o.new_token_ids):
            s.token_ids.append(tok)
            if s.logprobs is not None and o.logprobs is not None:
                s.logprobs.append(self._position(o.logprobs[i]))
                s.cumulative_logprob = (s.cumulative_logprob or 0.0) + o.logprobs[i].logprob
            new = s.detok.step(tok)
            s.text += new
            last = i == len(o.new_token_ids) - 1
            # a stop token or EOS ends the sequence before its text is matched (as when it is sampled)
            if new and r.stop and not (last and finish == "stop"):
                hit = _find_stop(s.text, new, r.stop)
                if hit is not None:
                    s.text = s.text[: hit[0]]
                    s.finish_reason, s.stop_reason = "stop", hit[1]
                    return not (last and o.finished)  # else the engine still runs it
        s.finish_reason, s.stop_reason = finish, stop_reason
        return False

    def _position(self, lp: TokenLogprobs) -> PositionLogprobs:
        out = {lp.token_id: Logprob(lp.logprob, lp.rank, self._decode(lp.token_id))}
        for rank, (tok, value) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            out.setdefault(tok, Logprob(value, rank, self._decode(tok)))
        return out

    def _decode(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token], skip_special_tokens=False)


def _flush(seqs: list[_Sequence]) -> None:
    """Detokenizes the sequences' pending tokens, in one batch."""
    for s, text in zip(seqs, extend_all([s.detok for s in seqs], [s.pending for s in seqs])):
        s.text += text
        s.pending = []


def _find_stop(text: str, new: str, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that the text ending in ``new`` now contains: (position, string)."""
    tail_start = max(0, len(text) - len(new) - max(len(s) for s in stops))
    hits = [(text.find(s, tail_start), s) for s in stops]
    hits = [(pos, s) for pos, s in hits if pos >= 0]
    return min(hits) if hits else None
