"""The prefill progress of an API request (its prompts together), as jobs report it
(``GET /v1/jobs/{id}``) and as streams send it with ``stream_options.include_progress``: prompt
tokens done out of the total, the cached ones among them, the rate since the first report and the
time left at that rate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from afdserve.engine.outputs import RequestOutput


@dataclass(frozen=True)
class Progress:
    done: int  # prompt tokens whose K/V are computed (cached ones included)
    total: int
    cached: int = 0  # prompt tokens served from the prefix cache
    rate: float | None = None  # prompt tokens per second since the first report (None before two)
    eta: float | None = None  # seconds left at that rate (0 once done)

    def to_json(self) -> dict[str, Any]:
        return {"prompt_tokens_done": self.done, "prompt_tokens_total": self.total, "cached_tokens": self.cached,
                "tokens_per_second": None if self.rate is None else round(self.rate, 3),
                "eta_seconds": None if self.eta is None else round(self.eta, 3)}


class ProgressMeter:
    """Turns the latest outputs of a request's prompts into a ``Progress`` (monotone: it never goes back)."""

    def __init__(self, prompt_lens: Sequence[int]):
        self.prompt_lens = list(prompt_lens)
        self.first: tuple[float, int] | None = None  # (time, done) of the first report
        self.last = Progress(0, sum(self.prompt_lens))

    def update(self, outs: Sequence[RequestOutput | None], now: float) -> Progress:
        done = total = cached = 0
        for n, o in zip(self.prompt_lens, outs):
            p = None if o is None else o.prefill
            total += n if p is None else max(n, p.total)
            done += 0 if p is None else p.done
            cached += 0 if o is None or o.num_cached_tokens is None else o.num_cached_tokens
        done = max(done, self.last.done)
        if done <= self.last.done and cached == self.last.cached:
            return self.last
        if self.first is None:
            self.first = (now, done)
        t0, d0 = self.first
        rate = (done - d0) / (now - t0) if now > t0 and done > d0 else None
        eta = 0.0 if done >= total else (total - done) / rate if rate else None
        self.last = Progress(done, total, cached, rate, eta)
        return self.last
