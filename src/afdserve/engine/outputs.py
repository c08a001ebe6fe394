"""What an engine reports: ``TokenOutput`` (the engine core, per request and step: new token ids and
finish events only) and ``RequestOutput`` (the front end, in vLLM's shape: cumulative text and ids)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenOutput:
    """A request's progress in one engine step, as the engine core (or an attention worker) reports
    it: the tokens it sampled and, once it is done, why."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS or a stop token), "length", "abort", or None while running
    stop_reason: int | None = None  # the stop token id that ended it
    error: str | None = None  # set when the request failed (a worker fault)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
