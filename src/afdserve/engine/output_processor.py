"""The front end's half of a request's output: token ids in, text and vLLM-shaped outputs out.

The engine core (or an attention worker) reports new token ids and finish events only. Here each
request's tokens are detokenized incrementally, stop strings are matched (a hit finishes the
request, and the caller aborts it in the engine, as vLLM's front end does), and the cumulative
``RequestOutput`` is built once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from afdserve.engine.detokenizer import IncrementalDetokenizer
from afdserve.engine.outputs import CompletionOutput, RequestOutput, TokenOutput
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.tokenizer import TokenizerInfo


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    stop: list[str]
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""


class OutputProcessor:
    def __init__(self, tokenizer: TokenizerInfo | None):
        self.tokenizer = tokenizer.tokenizer if tokenizer is not None else None
        self.live: dict[str, _Request] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids)
        self.live[request_id] = _Request(prompt, prompt_token_ids, list(params.stop or []), detok)

    def drop(self, request_id: str) -> None:
        self.live.pop(request_id, None)

    def process(self, outs: list[TokenOutput]) -> tuple[list[RequestOutput], list[str]]:
        """The outputs of the requests that progressed (one each, the latest) and the ids of the
        requests a stop string finished, which the engine must abort. Tokens of requests that are
        no longer live (finished or aborted meanwhile) are dropped."""
        latest: dict[str, RequestOutput] = {}
        stopped: list[str] = []
        for o in outs:
            r = self.live.get(o.request_id)
            if r is None:
                continue
            finish, stop_reason = o.finish_reason, o.stop_reason
            for i, tok in enumerate(o.new_token_ids):
                r.token_ids.append(tok)
                new = r.detok.step(tok)
                r.text += new
                last = i == len(o.new_token_ids) - 1
                # a stop token or EOS ends the request before its text is matched (as when it is sampled)
                if new and r.stop and not (last and finish == "stop"):
                    hit = _find_stop(r.text, new, r.stop)
                    if hit is not None:
                        r.text = r.text[: hit[0]]
                        finish, stop_reason = "stop", hit[1]
                        if not (last and o.finished):
                            stopped.append(o.request_id)  # the engine still runs it
                        break
            done = finish is not None
            latest[o.request_id] = RequestOutput(
                o.request_id, r.prompt, r.prompt_token_ids,
                [CompletionOutput(0, r.text, list(r.token_ids), finish, stop_reason)], finished=done, error=o.error)
            if done:
                del self.live[o.request_id]
        return list(latest.values()), stopped


def _find_stop(text: str, new: str, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that the text ending in ``new`` now contains: (position, string)."""
    tail_start = max(0, len(text) - len(new) - max(len(s) for s in stops))
    hits = [(text.find(s, tail_start), s) for s in stops]
    hits = [(pos, s) for pos, s in hits if pos >= 0]
    return min(hits) if hits else None
