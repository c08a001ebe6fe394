"""Request outputs travel from attention workers to the front end as deltas.

A worker's engine produces a full ``RequestOutput`` per request and step (prompt ids, every token
so far, the whole text); pickling those for a few hundred requests every step costs the worker and
the front end milliseconds that grow with the context. The worker sends only what changed since its
last message; the front end keeps each request's accumulated output and rebuilds the same
``RequestOutput`` the colocated engine would have returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from afdserve.engine.outputs import CompletionOutput, RequestOutput

# (request id, new token ids, kept chars of the text sent so far, new text, finish reason,
#  stop reason, finished, error)
Delta = tuple[str, list[int], int, str, "str | None", "int | str | None", bool, "str | None"]


class DeltaEncoder:
    """Worker side: what each request's output gained since the last ``encode``."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[int, int]] = {}  # request id -> (tokens, chars) already sent

    def encode(self, outs: list[RequestOutput]) -> list[Delta]:
        deltas = []
        for o in outs:
            n_tok, n_chr = self._sent.pop(o.request_id, (0, 0))
            c = o.outputs[0] if o.outputs else CompletionOutput(0, "", [])
            keep = min(n_chr, len(c.text))  # a stop string can cut text that was already sent
            deltas.append((o.request_id, c.token_ids[n_tok:], keep, c.text[keep:], c.finish_reason, c.stop_reason,
                           o.finished, o.error))
            if not o.finished:
                self._sent[o.request_id] = (len(c.token_ids), len(c.text))
        return deltas


@dataclass
class _Partial:
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""


class DeltaDecoder:
    """Front-end side: accumulates each request's deltas into full ``RequestOutput``s."""

    def __init__(self) -> None:
        self._live: dict[str, _Partial] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self._live[request_id] = _Partial(prompt, prompt_token_ids)

    def drop(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def decode(self, d: Delta) -> RequestOutput:
        rid, ids, keep, text, finish_reason, stop_reason, finished, error = d
        p = self._live.get(rid) or _Partial(None, [])
        p.token_ids.extend(ids)
        p.text = p.text[:keep] + text
        if finished:
            self._live.pop(rid, None)
        return RequestOutput(rid, p.prompt, p.prompt_token_ids,
                             [CompletionOutput(0, p.text, list(p.token_ids), finish_reason, stop_reason)],
                             finished=finished, error=error)
