"""Log-probabilities in the OpenAI shapes: the completions API's (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``) and the chat API's (``content: [{token, logprob, bytes,
top_logprobs}]``). Alternatives are listed by rank; a log-probability of -inf is sent as -9999.0
(JSON has no infinity), as vLLM does."""

from __future__ import annotations

import math
from typing import Any

from afdserve.engine.outputs import Logprob, PositionLogprobs


def _value(lp: Logprob) -> float:
    return max(lp.logprob, -9999.0) if not math.isnan(lp.logprob) else -9999.0


def _token(token_id: int, lp: Logprob, as_ids: bool = False) -> str:
    return lp.decoded_token if lp.decoded_token is not None and not as_ids else f"token_id:{token_id}"


def _top(pos: PositionLogprobs, k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely tokens at a position, by rank."""
    ranked = sorted(((t, lp) for t, lp in pos.items() if lp.rank is not None and lp.rank <= k),
                    key=lambda x: x[1].rank)  # type: ignore[arg-type,return-value]
    return ranked[:k]


def completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None], k: int,
                        text_offset: int = 0, as_ids: bool = False) -> dict[str, Any]:
    """The completions API's ``logprobs`` object for ``token_ids`` (a position of None -- the first
    prompt token -- has no log-probability); offsets count from ``text_offset``; ``as_ids`` names
    tokens ``token_id:N``."""
    tokens, values, tops, offsets = [], [], [], []
    offset = text_offset
    for tok, pos in zip(token_ids, positions):
        lp = pos.get(tok) if pos is not None else None
        text = _token(tok, lp, as_ids) if lp is not None else None
        tokens.append(text if text is not None else "")
        values.append(_value(lp) if lp is not None else None)
        top = {_token(t, v, as_ids): _value(v) for t, v in _top(pos, k)} if pos is not None else None
        if top is not None and lp is not None:
            top.setdefault(text, _value(lp))  # the chosen token too, as OpenAI does
        tops.append(top)
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], k: int,
                  as_ids: bool = False) -> dict[str, Any]:
    """The chat API's ``logprobs`` object for ``token_ids``."""

    def entry(t: int, v: Logprob) -> dict[str, Any]:
        text = _token(t, v, as_ids)
        return {"token": text, "logprob": _value(v), "bytes": list(text.encode("utf-8"))}

    return {"content": [entry(tok, pos[tok]) | {"top_logprobs": [entry(t, v) for t, v in _top(pos, k)]}
                        for tok, pos in zip(token_ids, positions)]}
