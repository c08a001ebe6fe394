"""The completion and chat-completion endpoints: a validated request becomes engine prompts and
sampling params, then a JSON response or a server-sent-event stream of chunks.

Streams send each prompt's new text as it is generated; with stop strings they hold back the
last ``max(len(stop)) - 1`` characters until they are known not to start a stop string. A client
that disconnects aborts its prompts at once (their KV blocks are freed by the next engine step).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from afdserve.engine.outputs import RequestOutput
from afdserve.engine.sampling_params import SamplingParams
from afdserve.errors import RequestError
from afdserve.serving.async_engine import AsyncEngine, EngineOverloaded, EngineUnavailable, GenerationStream, Prompt
from afdserve.serving.chat import ChatTemplate
from afdserve.serving.errors import ApiError
from afdserve.serving.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList

GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (dividing logits by ~0 overflows)
RETRY_AFTER_S = 1


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, chat_template: ChatTemplate):
        self.engine, self.model_name, self.chat_template = engine, model_name, chat_template
        self.created = int(time.time())

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created,
                                         max_model_len=self.engine.max_model_len)])

    # ---- /v1/completions ---------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self._check_common(req)
        if req.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")
        if req.logprobs is not None:
            raise ApiError(400, "logprobs are not supported", param="logprobs", code="unsupported_parameter")
        if req.best_of not in (None, 1):
            raise ApiError(400, "best_of > 1 is not supported", param="best_of", code="unsupported_value")
        prompts = self._completion_prompts(req.prompt)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        self._check_context(prompts, max_tokens, "prompt")
        params = self._params(req, max_tokens)
        prefixes = [self._prompt_text(p) if req.echo else "" for p in prompts]
        stream = self._submit("cmpl", prompts, params)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(stream, self._completion_chunks(stream, prompts, params, prefixes, include_usage,
                                                        bool(req.return_token_ids)))
        outs = await _final(stream, raw)
        if outs is None:
            return Response(status_code=499)
        choices = [{"index": i, "text": prefixes[i] + o.outputs[0].text, "logprobs": None,
                    "finish_reason": o.outputs[0].finish_reason}
                   | ({"token_ids": o.outputs[0].token_ids} if req.return_token_ids else {})
                   for i, o in enumerate(outs)]
        return JSONResponse({"id": stream.request_id, "object": "text_completion", "created": int(time.time()),
                             "model": self.model_name, "choices": choices, "usage": _usage(prompts, outs)})

    # ---- /v1/chat/completions ------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self._check_common(req)
        if req.logprobs or req.top_logprobs is not None:
            raise ApiError(400, "logprobs are not supported", param="logprobs", code="unsupported_parameter")
        prompt = self._chat_prompt(req)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self.engine.max_model_len - len(prompt.token_ids) if limit is None else limit
        self._check_context([prompt], max_tokens, "messages")
        params = self._params(req, max_tokens)
        stream = self._submit("chatcmpl", [prompt], params)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(stream, self._chat_chunks(stream, prompt, params, include_usage, bool(req.return_token_ids)))
        outs = await _final(stream, raw)
        if outs is None:
            return Response(status_code=499)
        o = outs[0].outputs[0]
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": o.text}, "logprobs": None,
                                  "finish_reason": o.finish_reason}
        if req.return_token_ids:
            choice["token_ids"] = o.token_ids
        return JSONResponse({"id": stream.request_id, "object": "chat.completion", "created": int(time.time()),
                             "model": self.model_name, "choices": [choice], "usage": _usage([prompt], outs)})

    # ---- request -> engine ---------------------------------------------------------------
    def _check_common(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        if req.model != self.model_name:
            raise ApiError(400, f"The model '{req.model}' does not exist; this server serves '{self.model_name}'.",
                           param="model", code="model_not_found")
        if req.n not in (None, 1):
            raise ApiError(400, f"n={req.n} is not supported (only n=1)", param="n", code="unsupported_value")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise ApiError(400, f"{name} is not supported (only 0)", param=name, code="unsupported_value")
        if req.logit_bias:
            raise ApiError(400, "logit_bias is not supported", param="logit_bias", code="unsupported_parameter")
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options",
                           code="invalid_value")

    def _params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
        temperature = 1.0 if req.temperature is None else req.temperature
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=0.0 if temperature < GREEDY_BELOW else temperature,
                                  top_p=1.0 if req.top_p is None else req.top_p,
                                  top_k=-1 if req.top_k is None else req.top_k, seed=req.seed, stop=req.stop,
                                  ignore_eos=bool(req.ignore_eos))
        except RequestError as e:
            raise ApiError(400, str(e), param=_param_of(str(e)), code="invalid_value") from e

    def _tokenize(self, prompt: str | dict, param: str) -> Prompt:
        try:
            text, ids = self.engine.tokenize(prompt)
        except RequestError as e:
            raise ApiError(400, str(e), param=param, code="invalid_prompt") from e
        return Prompt(text, ids)

    def _completion_prompts(self, prompt: str | list) -> list[Prompt]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) or not prompt:
            items: list = [prompt]
        else:
            items = list(prompt)
        if len(items) > self.engine.max_in_flight:
            raise ApiError(400, f"{len(items)} prompts in one request; at most {self.engine.max_in_flight}",
                           param="prompt", code="invalid_value")
        return [self._tokenize(p if isinstance(p, str) else {"prompt_token_ids": p}, "prompt") for p in items]

    def _chat_prompt(self, req: ChatCompletionRequest) -> Prompt:
        tok = self.engine.tokenizer
        if tok is None:
            raise ApiError(400, "this model has no tokenizer: use /v1/completions with token ids", param="messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in req.messages]
        try:
            text = self.chat_template.render(messages)
        except RequestError as e:
            raise ApiError(400, str(e), param="messages", code="invalid_messages") from e
        ids = tok.tokenizer.encode(text, add_special_tokens=False).ids  # the template adds BOS itself
        return self._tokenize({"prompt_token_ids": ids, "prompt": text}, "messages")

    def _check_context(self, prompts: list[Prompt], max_tokens: int, param: str) -> None:
        limit = self.engine.max_model_len
        for p in prompts:
            if len(p.token_ids) + max_tokens > limit:
                raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                               f"{len(p.token_ids) + max_tokens} tokens ({len(p.token_ids)} in the {param}, "
                               f"{max_tokens} in the completion). Please reduce the length of the {param} or "
                               f"completion.", param=param, code="context_length_exceeded")

    def _submit(self, kind: str, prompts: list[Prompt], params: SamplingParams) -> GenerationStream:
        try:
            return self.engine.submit(f"{kind}-{uuid.uuid4().hex}", prompts, params)
        except EngineOverloaded as e:
            raise ApiError(429, f"The server is overloaded ({e}); retry later.", code="overloaded",
                           retry_after=RETRY_AFTER_S) from e
        except EngineUnavailable as e:
            raise ApiError(503, str(e), code="unavailable") from e

    def _prompt_text(self, p: Prompt) -> str:
        if p.text is not None:
            return p.text
        tok = self.engine.tokenizer
        return tok.decode(p.token_ids) if tok is not None else ""

    # ---- streams ---------------------------------------------------------------------------
    async def _completion_chunks(self, stream: GenerationStream, prompts: list[Prompt], params: SamplingParams,
                                 prefixes: list[str], include_usage: bool, token_ids: bool) -> AsyncIterator[str]:
        base = {"id": stream.request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        usage_field = {"usage": None} if include_usage else {}

        def chunk(i: int, text: str, finish: str | None, ids: list[int] | None) -> str:
            choice = {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
            if ids is not None:
                choice["token_ids"] = ids
            return _event(base | {"choices": [choice]} | usage_field)

        for i, prefix in enumerate(prefixes):
            if prefix:
                yield chunk(i, prefix, None, [] if token_ids else None)
        async for piece in _deltas(stream, params, token_ids):
            if isinstance(piece, str):
                yield piece
                return
            i, text, finish, ids = piece
            yield chunk(i, text, finish, ids)
        if include_usage:
            yield _event(base | {"choices": [], "usage": _usage(prompts, stream.latest)})
        yield "data: [DONE]\n\n"

    async def _chat_chunks(self, stream: GenerationStream, prompt: Prompt, params: SamplingParams,
                           include_usage: bool, token_ids: bool) -> AsyncIterator[str]:
        base = {"id": stream.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}
        usage_field = {"usage": None} if include_usage else {}

        def chunk(delta: dict, finish: str | None, ids: list[int] | None) -> str:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            if ids is not None:
                choice["token_ids"] = ids
            return _event(base | {"choices": [choice]} | usage_field)

        yield chunk({"role": "assistant", "content": ""}, None, None)
        async for piece in _deltas(stream, params, token_ids):
            if isinstance(piece, str):
                yield piece
                return
            _, text, finish, ids = piece
            yield chunk({"content": text} if text or not finish else {}, finish, ids)
        if include_usage:
            yield _event(base | {"choices": [], "usage": _usage([prompt], stream.latest)})
        yield "data: [DONE]\n\n"


async def _deltas(stream: GenerationStream, params: SamplingParams,
                  token_ids: bool) -> AsyncIterator[tuple[int, str, str | None, list[int] | None] | str]:
    """(prompt index, new text, finish reason, new token ids) as outputs arrive; on a failure, one
    error event followed by ``[DONE]`` (as a string) ends it."""
    stop = params.stop or []
    holdback = max((len(s) for s in stop), default=1) - 1
    n = len(stream.latest)
    sent_chars, sent_ids = [0] * n, [0] * n
    async for changed in stream:
        for i, out in changed:
            if out.error:
                err = ApiError(503, f"generation failed: {out.error}", code="generation_failed")
                yield _event(err.body().model_dump()) + "data: [DONE]\n\n"
                return
            comp = out.outputs[0]
            visible = len(comp.text) if out.finished else max(sent_chars[i], len(comp.text) - holdback)
            text = comp.text[sent_chars[i]:visible]
            new_ids = comp.token_ids[sent_ids[i]:]
            sent_chars[i], sent_ids[i] = max(sent_chars[i], visible), len(comp.token_ids)
            finish = comp.finish_reason if out.finished else None
            if text or finish or (token_ids and new_ids):
                yield i, text, finish, (new_ids if token_ids else None)


def _sse(stream: GenerationStream, body: AsyncIterator[str]) -> StreamingResponse:
    async def guarded() -> AsyncIterator[str]:
        try:
            async for piece in body:
                yield piece
        finally:  # the client went away (cancellation) or the stream ended: abort what is left
            stream.abort()

    return StreamingResponse(guarded(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(stream.abort))


async def _final(stream: GenerationStream, raw: Request) -> list[RequestOutput] | None:
    """Every prompt's final output, or None if the client disconnected first (then aborted)."""
    result = asyncio.ensure_future(stream.final())
    gone = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not result.done():
            result.cancel()
            stream.abort()
    if not result.done() or result.cancelled():
        return None
    if stream.error:
        raise ApiError(503, f"generation failed: {stream.error}", code="generation_failed")
    return result.result()


async def _disconnected(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


def _usage(prompts: list[Prompt], outs: list[RequestOutput | None]) -> dict[str, int]:
    p = sum(len(x.token_ids) for x in prompts)
    c = sum(len(o.outputs[0].token_ids) for o in outs if o is not None and o.outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _param_of(message: str) -> str | None:
    for name in ("max_tokens", "temperature", "top_p", "top_k", "stop", "seed"):
        if message.startswith(name):
            return name
    return None

