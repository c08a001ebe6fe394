"""What every ``EngineClient`` does the same way, whatever runs the engine: validate and tokenize
prompts, name requests, turn the engine's token ids into outputs (``OutputProcessor``) and abort the
requests a stop string finished. A deployment supplies three calls: ``submit``, ``cancel``, ``poll``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from afdserve.engine.output_processor import OutputProcessor
from afdserve.engine.outputs import RequestOutput, TokenOutput
from afdserve.engine.prompt import PromptInput, validate_prompt
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.structured_output import validate_structured_outputs
from afdserve.engine.tokenizer import TokenizerInfo
from afdserve.errors import RequestError


class FrontEnd:
    def __init__(self, tokenizer: TokenizerInfo | None, vocab_size: int, max_model_len: int, id_prefix: str = ""):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.outputs = OutputProcessor(tokenizer)
        self._ids = itertools.count()
        self._prefix = id_prefix

    # ---- what a deployment supplies ---------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        raise NotImplementedError

    def cancel(self, request_id: str) -> None:
        raise NotImplementedError

    def poll(self, timeout: float) -> list[TokenOutput]:
        raise NotImplementedError

    def submit_many(self, requests: list[tuple[str, list[int], SamplingParams]]) -> None:
        """Requests a caller added together (``add_requests``): a deployment whose workers take
        requests by message sends them together, so that none is scheduled before all have come. By
        default one ``submit`` each; if one fails, those submitted before it are cancelled."""
        done = 0
        try:
            for eid, ids, params in requests:
                self.submit(eid, ids, params)
                done += 1
        except BaseException:
            for eid, _, _ in requests[:done]:
                self.cancel(eid)
            raise

    # ---- the EngineClient calls ---------------------------------------------------------------
    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        return validate_prompt(prompt, self.tokenizer, self.vocab_size, self.max_model_len)

    def check_params(self, params: SamplingParams) -> None:
        """What the sampling params need of this model: token ids in its vocabulary, a structured-output
        spec that compiles (cached, so the engine's compile is a hit). RequestError otherwise."""
        bad = sorted(t for t in params.token_ids_used() if t >= self.vocab_size)
        if bad:
            raise RequestError(f"token ids {bad[:5]} in stop_token_ids / logit_bias are not in the vocabulary "
                               f"[0, {self.vocab_size})")
        if params.structured_outputs is not None:
            validate_structured_outputs(params.structured_outputs, self.tokenizer, self.vocab_size)

    def add_request(self, prompt: PromptInput, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        return self._add([(prompt, params, request_id)])[0]

    def add_requests(self, items: Sequence[tuple[PromptInput, SamplingParams | None]]) -> list[str]:
        """``add_request`` for several prompts at once (``LLM.generate``'s batch), submitted together
        (``submit_many``). All or nothing: when one is refused, none of them stays queued."""
        return self._add([(prompt, params, None) for prompt, params in items])

    def _add(self, items: list[tuple[PromptInput, SamplingParams | None, str | None]]) -> list[str]:
        """Validates and registers each request (a new id where it has none), then submits all their
        engine requests together; if one is refused or the submission fails, none stays queued."""
        rids: list[str] = []
        batch: list[tuple[str, list[int], SamplingParams]] = []
        try:
            for prompt, params, request_id in items:
                text, ids = self.tokenize(prompt)
                params = params or SamplingParams()
                self.check_params(params)
                rid = request_id if request_id is not None else f"{self._prefix}{next(self._ids)}"
                if self.outputs.is_taken(rid):
                    raise RequestError(f"duplicate request id {rid!r}")
                batch += [(eid, ids, p) for eid, p in self.outputs.add(rid, text, ids, params)]
                rids.append(rid)
            self.submit_many(batch)
        except BaseException:  # e.g. a failed deployment: nothing of them stays queued
            for rid in rids:
                self.outputs.drop(rid)
            raise
        return rids

    def abort(self, request_id: str) -> None:
        for eid in self.outputs.drop(request_id):
            self.cancel(eid)

    def has_unfinished(self) -> bool:
        return bool(self.outputs.live)

    def get_outputs(self, timeout: float = 0.0) -> list[RequestOutput]:
        outs, stopped = self.outputs.process(self.poll(timeout))
        for eid in stopped:
            self.cancel(eid)
        return outs
