"""Runs an ``EngineClient`` (any deployment) in one dedicated thread, apart from the HTTP server's
event loop.

The engine thread owns the client: between steps it takes new requests and aborts from a
thread-safe queue, then asks the client for outputs, then hands them to the event loop with one
``call_soon_threadsafe``. It never waits on HTTP: each request keeps only its *latest* output
(outputs are cumulative), so a slow client costs memory for one output, not a queue, and never a
stall. When nothing runs, the thread blocks on its queue for at most ``idle_poll_s`` (then lets the
client take in what its workers reported). Every turn of its loop is a heartbeat: ``heartbeat_age``
tells a stuck engine (a step or a call that does not return) from an idle one.

Shutting down: ``drain`` refuses new requests, gives those in flight a grace period, then ends the
rest with an ``unavailable`` error (streams send it as an error event); ``close`` stops the thread
and the deployment.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from afdserve.engine.client import EngineClient
from afdserve.engine.outputs import CompletionOutput, RequestOutput
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.stats import EngineStats
from afdserve.engine.tokenizer import TokenizerInfo

log = logging.getLogger("afdserve.serving")
SHUTTING_DOWN = "the server is shutting down"


class EngineOverloaded(Exception):
    """More requests in flight than the server admits; retry later."""


class EngineUnavailable(Exception):
    """The deployment failed (a worker died) or is shutting down."""


class Observer(Protocol):
    """Receives request timings (called on the event loop thread)."""

    def first_token(self, seconds: float) -> None: ...
    def between_tokens(self, seconds: float, count: int) -> None: ...
    def finished(self, reason: str, seconds: float) -> None: ...
    def micro_batches(self, sizes: list[int]) -> None: ...


@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]


class GenerationStream:
    """The outputs of one API request's prompts as they are generated. Iterating yields, each time,
    the prompts (by index) whose output changed since the last time, with their latest cumulative
    ``RequestOutput``; it ends when every prompt has finished. ``abort`` cancels what is left."""

    def __init__(self, engine: "AsyncEngine", request_id: str, num_prompts: int):
        self._engine, self.request_id = engine, request_id
        self.latest: list[RequestOutput | None] = [None] * num_prompts
        self._done = [False] * num_prompts
        self._changed: set[int] = set()
        self._event = asyncio.Event()
        self.error: str | None = None
        self.error_code = "generation_failed"  # "unavailable" when the server ended it (shutting down)

    def engine_id(self, index: int) -> str:
        return f"{self.request_id}-{index}"

    @property
    def finished(self) -> bool:
        return all(self._done)

    def _push(self, index: int, out: RequestOutput) -> None:
        if self._done[index]:
            return
        self.latest[index] = out
        self._changed.add(index)
        if out.finished:
            self._done[index] = True
            if out.error and self.error is None:
                self.error = out.error
        self._event.set()

    def __aiter__(self) -> "GenerationStream":
        return self

    async def __anext__(self) -> list[tuple[int, RequestOutput]]:
        while not self._changed:
            if self.finished:
                raise StopAsyncIteration
            await self._event.wait()
            self._event.clear()
        changed = sorted(self._changed)
        self._changed.clear()
        return [(i, self.latest[i]) for i in changed]  # type: ignore[misc]

    async def final(self) -> list[RequestOutput]:
        async for _ in self:
            pass
        return list(self.latest)  # type: ignore[arg-type]

    def abort(self) -> None:
        """Aborts the unfinished prompts (idempotent); their KV blocks are freed by the next step."""
        self._engine._abort(self)


@dataclass
class _Track:
    stream: GenerationStream
    index: int
    arrival: float
    sequences: int = 1  # the prompt's n
    tokens: int = 0
    last: float = 0.0


class AsyncEngine:
    """The engine behind the HTTP server. Call ``start`` and, at the end, ``close`` on the event loop."""

    def __init__(self, engine: EngineClient, *, max_in_flight: int, observer: Observer | None = None,
                 poll_s: float = 0.005, idle_poll_s: float = 0.05, stats_interval_s: float = 1.0,
                 rebalance_interval_s: float | None = None):
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.observer = observer
        self.poll_s, self.idle_poll_s, self.stats_interval_s = poll_s, idle_poll_s, stats_interval_s
        self.rebalance_interval_s = rebalance_interval_s  # re-plan expert placement this often
        self._queue: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._tracks: dict[str, _Track] = {}  # engine request id -> its stream (event loop thread only)
        self._snapshot = EngineStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._failed: str | None = None
        self._beat = time.monotonic()  # the engine thread's last turn
        self._closing = False
        self._closed = False
        self._stats_failed = False

    # ---- properties the server reads -----------------------------------------------------
    @property
    def tokenizer(self) -> TokenizerInfo | None:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def failed(self) -> str | None:
        return self._failed

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def heartbeat_age(self) -> float:
        """Seconds since the engine thread last went round its loop (inf once it is gone)."""
        if self._thread is None or not self._thread.is_alive():
            return float("inf")
        return max(0.0, time.monotonic() - self._beat)

    @property
    def in_flight(self) -> int:
        """Sequences accepted and not finished (a prompt with n > 1 counts n times)."""
        return sum(tr.sequences for tr in self._tracks.values())

    def stats(self) -> EngineStats:
        return self._snapshot

    def tokenize(self, prompt: str | dict | list[int]) -> tuple[str | None, list[int]]:
        """Validates and tokenizes a prompt (read-only on the engine: safe from any thread)."""
        return self.engine.tokenize(prompt)

    def check_params(self, params: SamplingParams) -> None:
        """RequestError if the model cannot serve ``params`` (read-only: safe from any thread)."""
        self.engine.check_params(params)

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._beat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="afdserve-engine", daemon=True)
        self._thread.start()

    async def close(self, timeout: float = 60.0) -> None:
        """Stops the engine thread, fails what is still in flight, and shuts the engine (and its
        worker processes) down. Call it on the event loop."""
        if self._closed:
            return
        self._closed = self._closing = True
        self._queue.put(("stop",))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        self._fail_all(SHUTTING_DOWN, "unavailable")
        await asyncio.to_thread(self.engine.shutdown)

    async def drain(self, grace_s: float, hurry: Callable[[], bool] = lambda: False) -> None:
        """Refuses new requests, waits up to ``grace_s`` (or until ``hurry()``) for those in flight, then
        ends the rest with an ``unavailable`` error. Call it on the event loop when the server starts
        shutting down."""
        self._closing = True
        deadline = time.monotonic() + grace_s
        while self._tracks and time.monotonic() < deadline and self.heartbeat_age < float("inf") and not hurry():
            await asyncio.sleep(0.05)
        if self._tracks:
            log.info("ending %d request(s) still in flight: the server is shutting down", len(self._tracks))
            self._fail_all(SHUTTING_DOWN, "unavailable")

    # ---- requests (event loop thread) ----------------------------------------------------
    def submit(self, request_id: str, prompts: Sequence[Prompt], params: SamplingParams) -> GenerationStream:
        """Queues the prompts of one API request; raises EngineUnavailable or EngineOverloaded."""
        if self._failed:
            raise EngineUnavailable(f"the deployment failed: {self._failed}")
        if self._closing or self._thread is None:
            raise EngineUnavailable(SHUTTING_DOWN if self._closing else "the server is not running")
        in_flight = self.in_flight
        if in_flight + len(prompts) * params.n > self.max_in_flight:
            raise EngineOverloaded(f"{in_flight} sequences in flight, {len(prompts) * params.n} more asked for "
                                   f"(at most {self.max_in_flight})")
        stream = GenerationStream(self, request_id, len(prompts))
        now = time.monotonic()
        for i, p in enumerate(prompts):
            rid = stream.engine_id(i)
            self._tracks[rid] = _Track(stream, i, now, params.n)
            self._queue.put(("add", rid, {"prompt_token_ids": p.token_ids, "prompt": p.text}, params))
        return stream

    def _abort(self, stream: GenerationStream) -> None:
        for i in range(len(stream.latest)):
            rid = stream.engine_id(i)
            tr = self._tracks.pop(rid, None)
            if tr is not None:
                if self.observer:
                    self.observer.finished("abort", time.monotonic() - tr.arrival)
                stream._done[i] = True
                self._queue.put(("abort", rid))
        stream._event.set()

    def _deliver(self, outs: list[RequestOutput], t: float) -> None:
        obs = self.observer
        for out in outs:
            tr = self._tracks.get(out.request_id)
            if tr is None:
                continue  # aborted meanwhile
            n = sum(len(c.token_ids) for c in out.outputs)
            if n > tr.tokens and obs:
                if tr.tokens == 0:
                    obs.first_token(t - tr.arrival)
                else:
                    obs.between_tokens(t - tr.last, n - tr.tokens)
            if n > tr.tokens:
                tr.tokens, tr.last = n, t
            if out.finished:
                del self._tracks[out.request_id]
                if obs:
                    reason = out.outputs[0].finish_reason if out.outputs and not out.error else None
                    obs.finished(reason or "error", t - tr.arrival)
            tr.stream._push(tr.index, out)

    def _fail_all(self, reason: str, code: str = "generation_failed") -> None:
        for tr in self._tracks.values():
            tr.stream.error_code = code
        self._deliver([_error_output(rid, reason) for rid in list(self._tracks)], time.monotonic())

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        next_refresh = time.monotonic()
        every = self.rebalance_interval_s
        next_rebalance = time.monotonic() + every if every else float("inf")
        try:
            while True:
                self._beat = time.monotonic()
                busy = eng.has_unfinished()
                wait = None if busy else min(self.idle_poll_s, max(0.0, next_refresh - time.monotonic()))
                outs: list[RequestOutput] = []
                for cmd in self._take(wait):
                    if cmd[0] == "stop":
                        return
                    outs += self._apply(cmd)
                outs += eng.get_outputs(self.poll_s if eng.has_unfinished() else 0.0)
                now = time.monotonic()
                if now >= next_refresh:
                    self._stats(eng.refresh_stats)
                    next_refresh = now + self.stats_interval_s
                snap = self._stats(eng.stats)
                if snap is not None:
                    self._snapshot = dataclasses.replace(snap, waiting=snap.waiting + self._queue.qsize())
                sizes = snap.micro_batch_sizes if snap is not None else []
                if now >= next_rebalance:
                    next_rebalance = now + every  # type: ignore[operator]
                    try:  # between steps, like any control message; serving goes on meanwhile
                        eng.rebalance()
                    except Exception as e:  # no load yet, or nothing to gain: keep serving
                        log.info("periodic re-plan skipped: %s", e)
                if eng.failed and not self._failed:
                    self._failed = eng.failed
                    log.error("deployment failed: %s", eng.failed)
                if (outs or sizes) and self._loop is not None:
                    self._loop.call_soon_threadsafe(self._on_step, _latest(outs), sizes, now)
        except BaseException as e:  # a bug or a broken engine: fail everything, refuse new requests
            reason = f"engine loop failed: {type(e).__name__}: {e}"
            log.exception("engine loop failed")
            self._failed = reason
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all, reason)

    def _stats(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Stats never stop serving: a failure is logged (once) and the figures go stale."""
        try:
            return fn(*args)
        except Exception:
            if not self._stats_failed:
                self._stats_failed = True
                log.exception("reading the deployment's stats failed; metrics may be stale")
            return None

    def _on_step(self, outs: list[RequestOutput], sizes: list[int], t: float) -> None:
        if sizes and self.observer:
            self.observer.micro_batches(sizes)
        if outs:
            self._deliver(outs, t)

    def _take(self, wait: float | None) -> list[tuple]:
        """Every queued command; blocks up to ``wait`` seconds for the first (None: don't block)."""
        cmds = []
        try:
            cmds.append(self._queue.get(timeout=wait) if wait else self._queue.get_nowait())
            while True:
                cmds.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        return cmds

    async def call(self, fn: Callable[[EngineClient], Any]) -> Any:
        """Runs ``fn(engine)`` in the engine thread between two steps and returns its result
        (re-planning, snapshots: anything that must not race with a step)."""
        if self._loop is None:
            raise EngineUnavailable("the engine is not running")
        fut: asyncio.Future = self._loop.create_future()
        self._queue.put(("call", fn, fut))
        return await fut

    def _apply(self, cmd: tuple) -> list[RequestOutput]:
        if cmd[0] == "call":
            _, fn, fut = cmd
            loop = self._loop
            try:
                res = fn(self.engine)
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(res))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(lambda e=e: fut.done() or fut.set_exception(e))
            return []
        if cmd[0] == "add":
            _, rid, prompt, params = cmd
            try:
                self.engine.add_request(prompt, params, request_id=rid)
            except Exception as e:  # validated already; a failed deployment refuses here
                return [_error_output(rid, f"{type(e).__name__}: {e}")]
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])
        return []


def _latest(outs: list[RequestOutput]) -> list[RequestOutput]:
    """The last output of each request (a cluster step may bring several; they are cumulative)."""
    if len(outs) < 2:
        return outs
    by_id: dict[str, RequestOutput] = {}
    for o in outs:
        by_id.pop(o.request_id, None)
        by_id[o.request_id] = o
    return list(by_id.values())


def _error_output(rid: str, reason: str) -> RequestOutput:
    return RequestOutput(rid, None, [], [CompletionOutput(0, "", [], "abort")], finished=True, error=reason)
