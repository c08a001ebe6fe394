"""Checks and tokenizes a prompt before anything is queued (the front end's first step)."""

from __future__ import annotations

from afdserve.engine.tokenizer import TokenizerInfo
from afdserve.errors import RequestError

PromptInput = str | dict | list[int]


def validate_prompt(prompt: PromptInput, tok: TokenizerInfo | None, vocab: int,
                    max_model_len: int) -> tuple[str | None, list[int]]:
    """Returns (text, token ids); raises RequestError naming the problem."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt:
            raise RequestError("a dict prompt needs 'prompt_token_ids'")
        text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
    elif isinstance(prompt, str):
        if not prompt:
            raise RequestError("empty prompt")
        if tok is None:
            raise RequestError("this engine has no tokenizer: pass {'prompt_token_ids': [...]}")
        text, ids = prompt, tok.encode(prompt)
    elif isinstance(prompt, list):
        text, ids = None, prompt
    else:
        raise RequestError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
    ids = list(ids)
    if not ids:
        raise RequestError("empty prompt")
    # the common case in two builtin passes (a bool is an int and passes them: the exact check then)
    if not (all(type(t) is int for t in ids) and 0 <= min(ids) and max(ids) < vocab):
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab})")
    if len(ids) >= max_model_len:
        raise RequestError(
            f"prompt has {len(ids)} tokens; the model's context is {max_model_len} tokens "
            f"(prompt + at least one generated token must fit)"
        )
    return text, ids
