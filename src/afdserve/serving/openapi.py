"""The server's OpenAPI schema: FastAPI's, plus the limits of this deployment that validation checks
(the served model's name, the vocabulary, the most prompts in one request, the number of experts,
a job's body not streamed),
so that the schema accepts exactly what the server does."""

from __future__ import annotations

from typing import Any

from afdserve.serving.admin import limit_admin_schema


def limit_schema(schema: dict[str, Any], model_name: str, vocab_size: int, max_prompts: int,
                 num_experts: int | None) -> None:
    schemas = schema["components"]["schemas"]
    top = vocab_size - 1
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        props["model"]["enum"] = [model_name]
        _branch(props["stop_token_ids"], "array")["items"]["maximum"] = top
        _branch(props["logit_bias"], "object")["propertyNames"] = {"pattern": int_range_pattern(top)}
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    for option in prompt:
        if option.get("type") == "array":
            items = option["items"]
            if items.get("type") == "integer":  # one prompt of token ids
                items["maximum"] = top
            else:  # a batch
                option["maxItems"] = max_prompts
                if items.get("type") == "array":
                    items["items"]["maximum"] = top
    for name in ("TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest"):
        _branch(schemas[name]["properties"]["model"], "string")["enum"] = [model_name]
    schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] = top
    job = schema["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    job["properties"] = {"stream": {"enum": [False, None]}}  # a job is not streamed (it has /events)
    limit_admin_schema(schema, num_experts)


def _branch(prop: dict[str, Any], kind: str) -> dict[str, Any]:
    """The member of ``anyOf`` (a nullable field) of JSON type ``kind``."""
    return next(o for o in prop["anyOf"] if o.get("type") == kind)


def int_range_pattern(top: int) -> str:
    """A regular expression for the decimal integers 0..top (no sign, no leading zeros)."""
    s = str(top)
    alts = ["[0-9]" if n == 1 else f"[1-9][0-9]{{{n - 1}}}" for n in range(1, len(s))]
    for i, digit in enumerate(s):
        rest = len(s) - i - 1
        lo = 1 if i == 0 and len(s) > 1 else 0
        hi = int(digit) - (1 if rest else 0)
        if hi >= lo:
            alts.append(s[:i] + f"[{lo}-{hi}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    return "^(" + "|".join(alts) + ")$"
