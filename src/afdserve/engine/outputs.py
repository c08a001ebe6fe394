"""What an engine reports: ``TokenOutput`` (the engine core, per request and step: new token ids and
finish events only) and ``RequestOutput`` (the front end, in vLLM's shape: cumulative text and ids)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position, as the engine core computes them (from the model's raw
    logits, before penalties, temperature or masks): the chosen token's and the top alternatives'."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class Logprob:
    """vLLM's per-token log-probability entry (``CompletionOutput.logprobs[i][token_id]``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]  # the chosen token first, then the top alternatives by rank


@dataclass(frozen=True)
class PrefillProgress:
    """How far a request's prefill is: positions whose K/V are computed (prefix-cache hits
    included) out of the positions it prefills (the prompt, plus a re-admitted request's tokens)."""

    done: int
    total: int


@dataclass
class TokenOutput:
    """A request's progress in one engine step, as the engine core (or an attention worker) reports
    it: the tokens it sampled and, once it is done, why; or, for a step that computed a chunk of a
    longer prefill, no tokens and ``prefill``."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS or a stop token), "length", "abort", or None while running
    stop_reason: int | None = None  # the stop token id that ended it
    error: str | None = None  # set when the request failed (a worker fault)
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for them
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.. (with the first new token)
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (on the request's first output)
    prefill: PrefillProgress | None = None  # a step that computed part of the prompt (no new tokens then)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __reduce__(self) -> tuple[type[TokenOutput], tuple]:
        # pickled as its fields' values in order, not as a dict of them: an attention worker sends
        # one per sequence and step (a third of the bytes; unpickled several times faster)
        return TokenOutput, _token_output_fields(self)


_token_output_fields = attrgetter(*(f.name for f in fields(TokenOutput)))


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None  # per generated token, when asked for
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # None for the first prompt token
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (once known)
    prefill: PrefillProgress | None = None  # the prefill's progress so far (None before the first report)
