"""A request as the scheduler sees it: its tokens, progress and state."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from afdserve.engine.cp import CPShard
from afdserve.engine.outputs import TokenLogprobs
from afdserve.engine.sampling_params import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # of prompt tokens 1.., as computed
    grammar: object | None = None  # its structured-output matcher (afdserve.engine.structured_output)
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks so far
    num_cached_tokens: int | None = None  # prefix tokens not recomputed, set when first scheduled
    cp: CPShard | None = None  # its part of a context-parallel prefill (``afdserve.engine.cp``)
    plain: bool = field(init=False)  # params.argmax_of_raw_logits, read every step (params are fixed)

    def __post_init__(self) -> None:
        self.plain = self.params.argmax_of_raw_logits
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids of positions [start, end) without building the whole list."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - p)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
