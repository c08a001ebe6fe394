"""``EngineClient``: the one interface of every deployment (the colocated engine in this process,
a cluster of local worker processes, Ray actors). ``LLM`` and the API server use only this."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from afdserve.balance.load import LoadSnapshot
from afdserve.balance.placement import Placement
from afdserve.config import EngineConfig
from afdserve.engine.outputs import RequestOutput
from afdserve.engine.prompt import PromptInput
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.stats import EngineStats
from afdserve.engine.tokenizer import TokenizerInfo


@dataclass(frozen=True)
class RebalanceResult:
    version: int  # of the expert map now in use
    experts_per_worker: list[list[list[int]]]  # [expert worker][layer] -> logical experts it holds


@dataclass(frozen=True)
class ScaleResult:
    attention_workers: int
    expert_workers: int
    epoch: int  # the membership epoch of the resized deployment
    map_version: int  # of the expert map now in use (re-placed when the expert pool changed)
    seconds: float  # from the request until every worker of the new membership was ready
    experts_per_worker: list[list[list[int]]]  # [expert worker][layer] -> logical experts it holds


class EngineClient(Protocol):
    config: EngineConfig
    tokenizer: TokenizerInfo | None
    vocab_size: int
    max_model_len: int

    @property
    def failed(self) -> str | None:
        """Why the deployment cannot serve (None while it can)."""

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """Validates a prompt: (text, token ids), or RequestError. Read-only: safe from any thread."""

    def check_params(self, params: SamplingParams) -> None:
        """RequestError if ``params`` cannot be served by this model (token ids, structured outputs);
        ``add_request`` checks this too. Read-only: safe from any thread."""

    def add_request(self, prompt: PromptInput, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str: ...

    def add_requests(self, items: Sequence[tuple[PromptInput, SamplingParams | None]]) -> list[str]:
        """Several requests, added together (all or none); their ids."""

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def get_outputs(self, timeout: float = 0.0) -> list[RequestOutput]:
        """Runs the deployment for a while and returns the latest output of each request that progressed
        (the colocated engine runs one step; a cluster waits up to ``timeout`` for its workers)."""

    def stats(self) -> EngineStats:
        """A snapshot of what the deployment reports (cheap: call it after every step)."""

    def refresh_stats(self) -> None:
        """Updates the slower figures (busy fractions, the expert-load window); call it every second or so."""

    def expert_load(self) -> LoadSnapshot | None: ...

    def rebalance(self, slots_per_worker: int | None = None, planner: str = "janus",
                  placement: Placement | None = None) -> RebalanceResult:
        """Moves experts to a placement planned from the recent load, while serving; ConfigError
        when the deployment has no expert workers."""

    def scale(self, attention_workers: int | None = None, expert_workers: int | None = None) -> ScaleResult:
        """Resizes the attention and/or expert pool while serving (None: unchanged); ConfigError
        when the deployment cannot (no expert workers, a launcher that cannot start workers)."""

    def set_micro_batches(self, m: int) -> None: ...

    def shutdown(self) -> None: ...
