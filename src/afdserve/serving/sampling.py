"""An OpenAI request's sampling fields as the engine's ``SamplingParams``: OpenAI's names and vLLM's
extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``,
``structured_outputs`` and the older ``guided_*`` names), ``response_format``, ``n``, log-probabilities."""

from __future__ import annotations

import re

from afdserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from afdserve.errors import RequestError
from afdserve.serving.errors import ApiError
from afdserve.serving.protocol import TOKEN_ID_KEY, ChatCompletionRequest, CompletionRequest

SEED_MODULUS = 2**63  # seeds are reduced to [0, 2**63): sequence i of n samples with seed + i (torch takes < 2**64)
GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (dividing logits by ~0 overflows)
_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "seed", "n", "min_tokens", "logit_bias",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "stop_token_ids", "logprobs")


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """Raises ApiError(400) naming the field for a value the engine refuses."""
    if isinstance(req, CompletionRequest) and req.best_of is not None and req.best_of != (req.n or 1):
        raise ApiError(400, f"best_of={req.best_of} must equal n={req.n or 1} (as in vLLM)", param="best_of",
                       code="unsupported_value")
    temperature = 1.0 if req.temperature is None else req.temperature
    bias = None
    if req.logit_bias:
        if not all(re.search(TOKEN_ID_KEY, k) for k in req.logit_bias):  # as JSON Schema's pattern reads
            raise ApiError(400, "logit_bias keys must be token ids (decimal, e.g. \"42\")", param="logit_bias",
                           code="invalid_value")
        bias = {int(k): v for k, v in req.logit_bias.items()}
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=0.0 if temperature < GREEDY_BELOW else temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
            min_p=req.min_p or 0.0, seed=None if req.seed is None else req.seed % SEED_MODULUS, stop=req.stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=bool(req.ignore_eos), n=req.n or 1, min_tokens=req.min_tokens or 0,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=bias, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured_outputs=structured_outputs(req))
    except RequestError as e:
        raise ApiError(400, str(e), param=_param_of(str(e)), code="invalid_value") from e


def structured_outputs(req: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The one output constraint a request asks for (``response_format``, ``structured_outputs`` or a
    ``guided_*`` field); 400 if it asks for several."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    try:
        rf = req.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise RequestError("response_format json_schema needs json_schema.schema")
            found.append(("response_format", StructuredOutputsParams(json=rf.json_schema.schema_)))
        so = req.structured_outputs
        if so is not None:
            found.append(("structured_outputs", StructuredOutputsParams(
                json=so.json_, json_object=bool(so.json_object), regex=so.regex,
                choice=tuple(so.choice) if so.choice is not None else None, grammar=so.grammar)))
        for name, kw in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                         ("guided_grammar", "grammar")):
            v = getattr(req, name)
            if v is not None:
                found.append((name, StructuredOutputsParams(**{kw: tuple(v) if kw == "choice" else v})))
    except RequestError as e:
        raise ApiError(400, str(e), param=found[-1][0] if found else "response_format", code="invalid_value") from e
    if len(found) > 1:
        raise ApiError(400, f"only one output constraint per request; got {', '.join(n for n, _ in found)}",
                       param=found[1][0], code="invalid_value")
    return found[0][1] if found else None


def _param_of(message: str) -> str | None:
    for name in _PARAMS:
        if message.startswith(name):
            return name
    return "structured_outputs" if message.startswith("structured outputs") else None
