"""The requests of a serving benchmark: ShareGPT conversations or synthetic fixed lengths.

ShareGPT follows vLLM's ``benchmark_serving``: shuffle the conversations, take each one's first
human turn as the prompt and the token count of the gpt turn answering it as the output length,
and drop pairs with fewer than 4 prompt or output tokens, more than 1024 prompt tokens or more
than 2048 tokens in all; ``max_input_len``/``max_output_len`` cap them further (longer prompts are
dropped, longer outputs are shortened). Synthetic prompts are random token ids, so their length is
exact.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from afdserve.bench.sharegpt import load_conversations

FIRST_TOKEN_ID = 3  # skip <unk>, <s>, </s> in synthetic prompts


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (synthetic)
    prompt_len: int
    output_len: int


def sharegpt_requests(tokenizer: Tokenizer, num: int, seed: int = 0, max_input_len: int | None = None,
                      max_output_len: int | None = None, max_model_len: int | None = None) -> list[BenchRequest]:
    convs = load_conversations()
    random.Random(seed).shuffle(convs)
    out: list[BenchRequest] = []
    for c in convs:
        if len(out) >= num:
            break
        p = len(tokenizer.encode(c.prompt, add_special_tokens=True).ids)
        o = len(tokenizer.encode(c.completion, add_special_tokens=False).ids)
        if p < 4 or o < 4 or p > 1024 or p + o > 2048:
            continue
        if max_input_len is not None and p > max_input_len:
            continue
        if max_output_len is not None:
            o = min(o, max_output_len)
        if max_model_len is not None and p + o > max_model_len:
            continue
        out.append(BenchRequest(c.prompt, p, o))
    if len(out) < num:
        raise ValueError(f"only {len(out)} ShareGPT conversations fit the length limits; asked for {num}")
    return out


def vocab_size(model_dir: Path, tokenizer: Tokenizer) -> int:
    """Token ids a synthetic prompt may use: the tokenizer's, or fewer if the model's embedding
    (``config.json``'s ``vocab_size``) is smaller."""
    n = tokenizer.get_vocab_size()
    cfg = model_dir / "config.json"
    if cfg.is_file():
        n = min(n, int(json.loads(cfg.read_text()).get("vocab_size", n)))
    return n


def synthetic_requests(num: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    if input_len < 1 or output_len < 1:
        raise ValueError("input and output lengths must be >= 1")
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(input_len)], input_len, output_len)
            for _ in range(num)]
