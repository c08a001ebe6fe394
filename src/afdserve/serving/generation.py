"""The completion and chat-completion endpoints: a validated request becomes engine prompts and
sampling params, then a JSON response or a server-sent-event stream of chunks.

Prompts are tokenized (and chat templates rendered) in a worker thread: a long prompt does not hold
up the event loop, so other streams go on meanwhile. Streams send each prompt's new text as it is
generated; with stop strings they hold back the last ``max(len(stop)) - 1`` characters until they
are known not to start a stop string. A client that disconnects aborts its prompts at once (their
KV blocks are freed by the next engine step); a stream the server ends (a failed deployment, a
shutdown) sends one error event, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from afdserve.engine.outputs import PositionLogprobs, RequestOutput
from afdserve.engine.sampling_params import SamplingParams
from afdserve.errors import RequestError
from afdserve.serving.async_engine import AsyncEngine, EngineOverloaded, EngineUnavailable, GenerationStream, Prompt
from afdserve.serving.chat import ChatTemplate, template_messages
from afdserve.serving.errors import ApiError
from afdserve.serving.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from afdserve.serving.logprobs import chat_logprobs, completion_logprobs
from afdserve.serving.progress import Progress, ProgressMeter
from afdserve.serving.sampling import sampling_params
from afdserve.serving.tokenization import encode
from afdserve.serving.tools import ToolConfig, ToolPlan, plan_tools

RETRY_AFTER_S = 1


@dataclass
class Prepared:
    """A validated completions or chat request, ready to submit: its prompts and sampling params,
    and how to answer it (``body``: the non-streaming JSON; ``chunks``: the SSE stream)."""

    kind: str  # "cmpl" | "chatcmpl" (the response id's prefix)
    prompts: list[Prompt]
    params: SamplingParams
    body: Callable[[str, list[RequestOutput]], dict[str, Any]]
    chunks: Callable[[GenerationStream], AsyncIterator[str]]


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, chat_template: ChatTemplate,
                 tool_config: ToolConfig = ToolConfig()):
        self.engine, self.model_name, self.chat_template = engine, model_name, chat_template
        self.tool_config = tool_config
        self.created = int(time.time())

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created,
                                         max_model_len=self.engine.max_model_len)])

    # ---- /v1/completions ---------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        return await self._respond(await self.prepare_completion(req), bool(req.stream), raw)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        return await self._respond(await self.prepare_chat(req), bool(req.stream), raw)

    def submit(self, prep: Prepared) -> GenerationStream:
        """Queues a prepared request (429 when the server is full, 503 when it cannot serve)."""
        return self._submit(prep.kind, prep.prompts, prep.params)

    async def _respond(self, prep: Prepared, streaming: bool, raw: Request) -> Response:
        stream = self.submit(prep)
        if streaming:
            return _sse(stream, prep.chunks(stream))
        outs = await _final(stream, raw)
        if outs is None:
            return Response(status_code=499)
        return JSONResponse(prep.body(stream.request_id, outs))

    async def prepare_completion(self, req: CompletionRequest) -> Prepared:
        self._check_common(req)
        if req.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")
        prompts = await self._completion_prompts(req.prompt)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        self._check_context(prompts, max_tokens, "prompt")
        k = req.logprobs
        params = await self._checked(sampling_params(req, max_tokens, logprobs=k,
                                                     prompt_logprobs=k if req.echo and k is not None else None))
        prefixes = [self._prompt_text(p) if req.echo else "" for p in prompts]
        opts = _StreamOpts.of(req)

        def chunks(stream: GenerationStream) -> AsyncIterator[str]:
            return self._completion_chunks(stream, prompts, params, prefixes, opts, bool(req.return_token_ids),
                                           bool(req.return_tokens_as_token_ids))

        return Prepared("cmpl", prompts, params, lambda rid, outs: self._completion_body(req, rid, prompts, params,
                                                                                         prefixes, outs), chunks)

    def _completion_body(self, req: CompletionRequest, rid: str, prompts: list[Prompt], params: SamplingParams,
                         prefixes: list[str], outs: list[RequestOutput]) -> dict[str, Any]:
        k = req.logprobs
        choices = []
        for i, o in enumerate(outs):
            for c in o.outputs:
                choice: dict[str, Any] = {"index": i * params.n + c.index, "text": prefixes[i] + c.text,
                                          "logprobs": None, "finish_reason": c.finish_reason}
                if k is not None and c.logprobs is not None:
                    ids, positions = c.token_ids, list(c.logprobs)
                    if req.echo and o.prompt_logprobs is not None:
                        ids, positions = o.prompt_token_ids + ids, list(o.prompt_logprobs) + positions
                    choice["logprobs"] = completion_logprobs(ids, positions, k,
                                                             as_ids=bool(req.return_tokens_as_token_ids))
                if req.return_token_ids:
                    choice["token_ids"] = c.token_ids
                choices.append(choice)
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": _usage(prompts, outs)}

    # ---- /v1/chat/completions ------------------------------------------------------------
    async def prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        self._check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
        k = (req.top_logprobs or 0) if req.logprobs else None
        tools = plan_tools(req.tools, req.tool_choice, self.chat_template, self.tool_config)
        prompt = await asyncio.to_thread(self._chat_prompt, req, tools)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self.engine.max_model_len - len(prompt.token_ids) if limit is None else limit
        self._check_context([prompt], max_tokens, "messages")
        params = await self._checked(tools.constrain(sampling_params(req, max_tokens, logprobs=k)))
        opts = _StreamOpts.of(req)

        def chunks(stream: GenerationStream) -> AsyncIterator[str]:
            return self._chat_chunks(stream, prompt, params, opts, bool(req.return_token_ids), tools,
                                     bool(req.return_tokens_as_token_ids))

        def body(rid: str, outs: list[RequestOutput]) -> dict[str, Any]:
            return self._chat_body(req, rid, prompt, k, tools, outs)

        return Prepared("chatcmpl", [prompt], params, body, chunks)

    def _chat_body(self, req: ChatCompletionRequest, rid: str, prompt: Prompt, k: int | None, tools: ToolPlan,
                   outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for o in outs[0].outputs:
            choice: dict[str, Any] = {"index": o.index, "message": {"role": "assistant", "content": o.text},
                                      "logprobs": None, "finish_reason": o.finish_reason}
            if k is not None and o.logprobs is not None:
                choice["logprobs"] = chat_logprobs(o.token_ids, o.logprobs, k, bool(req.return_tokens_as_token_ids))
            if req.return_token_ids:
                choice["token_ids"] = o.token_ids
            tools.apply(choice, o.text)
            choices.append(choice)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": _usage([prompt], outs)}

    # ---- request -> engine ---------------------------------------------------------------
    def _check_common(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        if req.model != self.model_name:
            raise ApiError(400, f"The model '{req.model}' does not exist; this server serves '{self.model_name}'.",
                           param="model", code="model_not_found")
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options",
                           code="invalid_value")

    async def _checked(self, params: SamplingParams) -> SamplingParams:
        """``params`` once the model can serve them (token ids in its vocabulary, a structured-output
        spec that compiles: compiled off the event loop, and cached for the engine)."""
        try:
            await asyncio.to_thread(self.engine.check_params, params)
        except RequestError as e:
            param = "structured_outputs" if str(e).startswith("structured outputs") else None
            raise ApiError(400, str(e), param=param, code="invalid_value") from e
        return params

    def _tokenize(self, prompt: str | list[int], param: str, add_special_tokens: bool = True) -> Prompt:
        """A prompt, validated (slow for long ones: call it in a worker thread)."""
        tok = self.engine.tokenizer
        engine_prompt: str | dict = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
        if isinstance(prompt, str) and prompt and tok is not None:
            ids = encode(tok, prompt, add_special_tokens)
            if len(ids) >= self.engine.max_model_len:  # before the engine checks every one of them
                raise ApiError(400, f"prompt has {len(ids)} tokens; the model's context is {self.engine.max_model_len} "
                               "tokens (prompt + at least one generated token must fit)", param=param,
                               code="context_length_exceeded")
            engine_prompt = {"prompt_token_ids": ids, "prompt": prompt}
        try:
            text, ids = self.engine.tokenize(engine_prompt)
        except RequestError as e:
            too_long = str(e).startswith("prompt has")  # more tokens than the context
            raise ApiError(400, str(e), param=param,
                           code="context_length_exceeded" if too_long else "invalid_prompt") from e
        return Prompt(text, ids)

    async def _completion_prompts(self, prompt: str | list) -> list[Prompt]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) or not prompt:
            items: list = [prompt]
        else:
            items = list(prompt)
        if len(items) > self.engine.max_in_flight:
            raise ApiError(400, f"{len(items)} prompts in one request; at most {self.engine.max_in_flight}",
                           param="prompt", code="invalid_value")
        return await asyncio.to_thread(
            lambda: [self._tokenize(p, "prompt") for p in items])

    def _chat_prompt(self, req: ChatCompletionRequest, tools: ToolPlan | None = None) -> Prompt:
        """The rendered, tokenized messages (slow for long ones: call it in a worker thread)."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ApiError(400, "this model has no tokenizer: use /v1/completions with token ids", param="messages")
        messages = template_messages(req.messages)
        try:
            text = self.chat_template.render(messages, tools.tools if tools is not None else None)
        except RequestError as e:
            raise ApiError(400, str(e), param="messages", code="invalid_messages") from e
        return self._tokenize(text, "messages", add_special_tokens=False)  # the template adds BOS itself

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
                                 prefixes: list[str], opts: "_StreamOpts", token_ids: bool,
                                 as_ids: bool = False) -> AsyncIterator[str]:
        base = {"id": stream.request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        usage_field = {"usage": None} if opts.usage else {}
        offsets: dict[int, int] = {}  # choice -> characters sent (for the logprobs' text offsets)

        def chunk(i: int, text: str, finish: str | None, ids: list[int] | None, logprobs: Any = None) -> str:
            choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
            if ids is not None:
                choice["token_ids"] = ids
            offsets[i] = offsets.get(i, 0) + len(text)
            return _event(base | {"choices": [choice]} | usage_field)

        for i, prefix in enumerate(prefixes):
            for j in range(params.n):
                if prefix:
                    yield chunk(i * params.n + j, prefix, None, [] if token_ids else None)
        async for d in _deltas(stream, params, token_ids, prompts if opts.progress else None):
            if isinstance(d, str):
                yield d
                return
            if isinstance(d, Progress):
                yield _event(base | {"choices": [], "progress": d.to_json()} | usage_field)
                continue
            lps = None
            if params.logprobs is not None and d.positions:
                lps = completion_logprobs(d.new_ids, d.positions, params.logprobs, offsets.get(d.index, 0), as_ids)
            yield chunk(d.index, d.text, d.finish, d.new_ids if token_ids else None, lps)
        if opts.usage:
            yield _event(base | {"choices": [], "usage": _usage(prompts, stream.latest)})
        yield "data: [DONE]\n\n"

    async def _chat_chunks(self, stream: GenerationStream, prompt: Prompt, params: SamplingParams,
                           opts: "_StreamOpts", token_ids: bool, tools: ToolPlan | None = None,
                           as_ids: bool = False) -> AsyncIterator[str]:
        base = {"id": stream.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}
        usage_field = {"usage": None} if opts.usage else {}

        def chunk(i: int, delta: dict, finish: str | None, ids: list[int] | None, logprobs: Any = None) -> str:
            choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            if ids is not None:
                choice["token_ids"] = ids
            return _event(base | {"choices": [choice]} | usage_field)

        for i in range(params.n):
            yield chunk(i, {"role": "assistant", "content": ""}, None, None)
        readers = {i: tools.stream() for i in range(params.n)} if tools is not None else {}
        readers = {i: r for i, r in readers.items() if r is not None}
        async for d in _deltas(stream, params, token_ids, [prompt] if opts.progress else None):
            if isinstance(d, str):
                yield d
                return
            if isinstance(d, Progress):
                yield _event(base | {"choices": [], "progress": d.to_json()} | usage_field)
                continue
            ids = d.new_ids if token_ids else None
            lps = chat_logprobs(d.new_ids, d.positions, params.logprobs, as_ids) \
                if params.logprobs is not None and d.positions else None
            if readers:  # tool calls: content and calls apart
                for delta, fin in readers[d.index].step(d.text, d.finish) or ([({}, None)] if ids or lps else []):
                    yield chunk(d.index, delta, fin, ids, lps)
                    ids, lps = ([] if ids is not None else None), None
                continue
            yield chunk(d.index, {"content": d.text} if d.text or not d.finish else {}, d.finish, ids, lps)
        if opts.usage:
            yield _event(base | {"choices": [], "usage": _usage([prompt], stream.latest)})
        yield "data: [DONE]\n\n"


class _StreamOpts(NamedTuple):
    usage: bool
    progress: bool

    @staticmethod
    def of(req: CompletionRequest | ChatCompletionRequest) -> "_StreamOpts":
        o = req.stream_options
        return _StreamOpts(bool(o and o.include_usage), bool(o and o.include_progress))


class Delta(NamedTuple):
    index: int  # the choice: prompt index * n + sequence index
    text: str
    finish: str | None
    new_ids: list[int]
    positions: list[PositionLogprobs] | None  # the new tokens' log-probabilities, when asked for


async def _deltas(stream: GenerationStream, params: SamplingParams, token_ids: bool,
                  progress_of: list[Prompt] | None = None) -> AsyncIterator[Delta | Progress | str]:
    """What each choice gained as outputs arrive (new tokens alone count when their ids or
    log-probabilities are sent), and with ``progress_of`` (the prompts) the prefill's progress
    whenever it moved; on a failure, one error event followed by ``[DONE]`` (as a string) ends it."""
    meter = ProgressMeter([len(p.token_ids) for p in progress_of]) if progress_of is not None else None
    stop = params.stop or []
    holdback = max((len(s) for s in stop), default=1) - 1
    sent_chars: dict[int, int] = {}
    sent_ids: dict[int, int] = {}
    done: set[int] = set()
    async for changed in stream:
        if meter is not None and not any(o.error for _, o in changed):
            before = meter.last
            p = meter.update(stream.latest, time.monotonic())
            if p is not before:
                yield p
        for i, out in changed:
            if out.error:
                yield _event(_failure(stream, out.error).body().model_dump()) + "data: [DONE]\n\n"
                return
            for comp in out.outputs:
                c = i * params.n + comp.index
                if c in done:
                    continue
                chars, n_ids = sent_chars.get(c, 0), sent_ids.get(c, 0)
                finish = comp.finish_reason
                visible = len(comp.text) if finish else max(chars, len(comp.text) - holdback)
                text = comp.text[chars:visible]
                new_ids = comp.token_ids[n_ids:]
                positions = comp.logprobs[n_ids:] if comp.logprobs is not None else None
                sent_chars[c], sent_ids[c] = max(chars, visible), len(comp.token_ids)
                if finish:
                    done.add(c)
                if text or finish or (new_ids and (token_ids or positions)):
                    yield Delta(c, text, finish, new_ids, positions)


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
        raise _failure(stream, stream.error)
    return result.result()


def _failure(stream: GenerationStream, error: str) -> ApiError:
    if stream.error_code == "unavailable":  # the server ended it
        return ApiError(503, error, code="unavailable")
    return ApiError(503, f"generation failed: {error}", code=stream.error_code)


async def _disconnected(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


def _usage(prompts: list[Prompt], outs: list[RequestOutput | None]) -> dict[str, Any]:
    p = sum(len(x.token_ids) for x in prompts)
    c = sum(len(comp.token_ids) for o in outs if o is not None for comp in o.outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outs if o is not None)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
