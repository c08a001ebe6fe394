"""Per-request generation options, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

from afdserve.errors import RequestError


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise RequestError(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if self.n != 1:
            raise RequestError(f"n={self.n} is not supported (only n=1)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
