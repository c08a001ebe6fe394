"""Per-request generation options, in vLLM's shape (and with vLLM's definitions)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from afdserve.errors import RequestError

MAX_LOGPROBS = 20  # top alternatives per position (vLLM's default max_logprobs)
OUTPUT_KINDS = ("cumulative", "final_only")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the generated text, enforced by a grammar (xgrammar) on every sampled token.
    Exactly one of the fields is set."""

    json: dict | str | None = None  # a JSON schema (dict or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # one of these strings
    grammar: str | None = None  # an EBNF grammar (GBNF / xgrammar syntax)

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        set_ = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise RequestError(f"structured outputs need exactly one of json, json_object, regex, choice, grammar; "
                               f"got {', '.join(set_) or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise RequestError("structured outputs: choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise RequestError(f"structured outputs: {name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise RequestError("structured outputs: json must be a JSON schema (an object or its JSON text)")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    min_tokens: int = 0  # EOS and stop token ids are not sampled before this many tokens
    presence_penalty: float = 0.0  # subtracted from the logits of tokens already generated
    frequency_penalty: float = 0.0  # subtracted once per time a token was already generated
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt or output tokens
    logit_bias: dict[int, float] | None = None  # added to the logits (clamped to [-100, 100])
    logprobs: int | None = None  # log-probability of each sampled token and of this many top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    structured_outputs: StructuredOutputsParams | None = None
    # "cumulative": an output every step, with everything so far (streaming); "final_only": one output,
    # when the request finishes (vLLM's RequestOutputKind; LLM.generate asks for it)
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def finite(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not finite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not finite(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
            raise RequestError(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if not finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not is_int(self.n) or self.n < 1:
            raise RequestError(f"n must be an integer >= 1, got {self.n!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not finite(v) or not -2 <= v <= 2:
                raise RequestError(f"{name} must be in [-2, 2], got {v!r}")
        if not finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise RequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise RequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop strings must be non-empty strings")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be token ids (integers >= 0)")
        if self.logit_bias is not None:
            if any(not is_int(t) or t < 0 or not finite(b) for t, b in self.logit_bias.items()):
                raise RequestError("logit_bias maps token ids (integers >= 0) to finite numbers")
            self.logit_bias = {int(t): max(-100.0, min(100.0, float(b))) for t, b in self.logit_bias.items()}
        if self.output_kind not in OUTPUT_KINDS:
            raise RequestError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise RequestError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def argmax_of_raw_logits(self) -> bool:
        """Greedy with nothing that reads or changes the logits first (logprobs, a grammar,
        penalties, a bias); ``min_tokens`` aside, which holds only until enough tokens are out."""
        return (self.greedy and self.logprobs is None and self.structured_outputs is None and not self.logit_bias
                and self.repetition_penalty == 1.0 and not self.frequency_penalty and not self.presence_penalty)

    def token_ids_used(self) -> set[int]:
        """Token ids this request names (checked against the vocabulary by the front end)."""
        return set(self.stop_token_ids) | set(self.logit_bias or ())
