"""An open-loop load generator for an OpenAI-compatible server.

Requests arrive as a Poisson process at ``request_rate`` (``inf``: all at once), optionally capped
at ``max_concurrency`` in flight, each a streaming (SSE) completion or chat completion. Every
request records when it was sent, when each chunk with tokens arrived, and how it ended.
Token counts come from the server (``return_token_ids`` per chunk and the final ``usage``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import httpx

from afdserve.bench.workload import BenchRequest


@dataclass
class RequestResult:
    prompt_len: int
    index: int = 0  # of the request in the list given to run_load
    token_ids: list[int] = field(default_factory=list)  # generated (the server returns them)
    output_len: int = 0  # tokens generated (server-reported)
    cached_tokens: int | None = None  # prompt tokens the server found in its prefix cache (usage, when reported)
    start: float = 0.0  # seconds since the run began
    ttft: float | None = None
    latency: float = 0.0
    gaps: list[float] = field(default_factory=list)  # time between consecutive output tokens
    ok: bool = False
    status: int | None = None
    error: str | None = None
    cancelled: bool = False  # the client hung up on purpose (``cancel_after_tokens``)
    clean: bool = False  # completed, cancelled, or an OpenAI-shaped error (status + error body or event)


@dataclass(frozen=True)
class LoadSpec:
    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    request_rate: float = math.inf
    max_concurrency: int | None = None
    duration_s: float | None = None  # keep issuing (cycling the requests) until then
    ignore_eos: bool = True
    timeout_s: float = 600.0
    seed: int = 0
    cancel_fraction: float = 0.0  # this share of requests hangs up after ``cancel_after_tokens``
    cancel_after_tokens: int = 4


def _body(spec: LoadSpec, req: BenchRequest) -> dict:
    body: dict = {"model": spec.model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}, "ignore_eos": spec.ignore_eos, "return_token_ids": True}
    if spec.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


async def send(client: httpx.AsyncClient, spec: LoadSpec, req: BenchRequest, t0: float,
               cancel_after: int | None = None, index: int = 0) -> RequestResult:
    path = "/v1/chat/completions" if spec.endpoint == "chat" else "/v1/completions"
    res = RequestResult(prompt_len=req.prompt_len, index=index)
    start = time.perf_counter()
    res.start = start - t0
    last = start
    tokens = 0
    complete = False
    try:
        async with client.stream("POST", spec.base_url.rstrip("/") + path, json=_body(spec, req)) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                message = _error_message(text)
                res.clean = message is not None
                res.error = f"HTTP {resp.status_code}: {message if res.clean else text[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    complete = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {chunk['error'].get('message')}"
                    res.clean = True
                    return res
                if chunk.get("usage"):
                    res.output_len = int(chunk["usage"]["completion_tokens"])
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        res.cached_tokens = int(details["cached_tokens"])
                for choice in chunk.get("choices") or ():
                    res.token_ids += choice.get("token_ids") or []
                    n = len(choice.get("token_ids") or ())
                    if n == 0 and (choice.get("text") or (choice.get("delta") or {}).get("content")):
                        n = 1  # a server without token ids: one token per chunk
                    if n == 0:
                        continue
                    now = time.perf_counter()
                    if tokens == 0:
                        res.ttft = now - start
                    else:
                        res.gaps += [(now - last) / n] * n
                    tokens += n
                    last = now
                if cancel_after is not None and tokens >= cancel_after:
                    res.cancelled = True
                    break  # leaving the block closes the connection mid-stream
        res.latency = time.perf_counter() - start
        res.output_len = res.output_len or tokens
        if not (complete or res.cancelled):
            res.error = "the stream ended without [DONE]"
            return res
        res.ok = not res.cancelled
        res.clean = True
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
        res.latency = time.perf_counter() - start
    return res


def _error_message(text: str) -> str | None:
    """The message of an OpenAI error body, or None if ``text`` is not one."""
    try:
        err = json.loads(text)["error"]
        return str(err["message"]) if isinstance(err, dict) and "type" in err else None
    except (ValueError, KeyError, TypeError):
        return None


async def run_load(spec: LoadSpec, requests: list[BenchRequest],
                   on_done: Callable[[RequestResult], None] | None = None) -> tuple[list[RequestResult], float]:
    """Issues the requests (cycled while ``duration_s`` lasts); returns the results and the run's
    duration (from the first send to the last completion)."""
    if not requests:
        raise ValueError("no requests")
    rng = random.Random(spec.seed)
    limit = spec.max_concurrency or 10_000
    sem = asyncio.Semaphore(limit)
    source: Iterable[tuple[int, BenchRequest]] = itertools.cycle(enumerate(requests)) if spec.duration_s \
        else enumerate(requests)
    timeout = httpx.Timeout(spec.timeout_s, connect=30.0)
    tasks: list[asyncio.Task[RequestResult]] = []
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=limit,
                                                                      max_keepalive_connections=limit)) as client:
        t0 = time.perf_counter()
        next_at = t0

        async def one(index: int, req: BenchRequest, cancel_after: int | None) -> RequestResult:
            try:
                res = await send(client, spec, req, t0, cancel_after, index)
            finally:
                sem.release()
            if on_done:
                on_done(res)
            return res

        def expired() -> bool:
            return spec.duration_s is not None and time.perf_counter() - t0 >= spec.duration_s

        for index, req in source:
            if math.isfinite(spec.request_rate):
                next_at += rng.expovariate(spec.request_rate)
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            await sem.acquire()
            if expired():
                sem.release()
                break
            cancel = spec.cancel_after_tokens if rng.random() < spec.cancel_fraction else None
            tasks.append(asyncio.create_task(one(index, req, cancel)))
        results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - t0
