"""Async jobs: a completions or chat request submitted once and followed by polling or events.

``POST /v1/jobs`` takes the body of a (non-streaming) completions or chat request, submits it
through the same ``OpenAIServing`` path (one ``EngineClient``) and answers at once with the job;
``GET /v1/jobs/{id}`` reports its status, the prefill's progress (``afdserve.serving.progress``) and,
once done, the result -- the body the non-streaming request would have got; ``GET
/v1/jobs/{id}/events`` streams progress, output text and the end as server-sent events;
``DELETE /v1/jobs/{id}`` cancels (the engine aborts it between two steps, on every worker). A job
is not tied to the connection that made it. Finished jobs are kept for ``ttl_s``; at most
``max_jobs`` are kept at once (429 beyond). Times come from ``JobStore.clock`` (injectable).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from afdserve.errors import ConfigError
from afdserve.serving.async_engine import GenerationStream
from afdserve.serving.errors import ApiError
from afdserve.serving.generation import Prepared, RETRY_AFTER_S
from afdserve.serving.progress import Progress, ProgressMeter

TERMINAL = ("succeeded", "failed", "cancelled")


@dataclass(frozen=True)
class JobOptions:
    ttl_s: float = 3600.0  # a finished job's result is kept this long
    max_jobs: int = 1024  # jobs kept at once (running and finished); more get 429

    def check(self) -> None:
        if not self.ttl_s > 0:
            raise ConfigError(f"invalid job_ttl_s={self.ttl_s}: must be > 0")
        if not isinstance(self.max_jobs, int) or self.max_jobs < 1:
            raise ConfigError(f"invalid max_jobs={self.max_jobs}: must be an integer >= 1")


class Job:
    """One job; its state changes on the event loop only."""

    def __init__(self, job_id: str, endpoint: str, prep: Prepared, stream: GenerationStream):
        self.id, self.endpoint, self.prep, self.stream = job_id, endpoint, prep, stream
        self.created = int(time.time())
        self.status = "queued"  # -> running -> succeeded | failed | cancelled
        self.meter = ProgressMeter([len(p.token_ids) for p in prep.prompts])
        self.progress = self.meter.last
        self.result: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.finished_at: float | None = None  # the store's clock
        self._changed = asyncio.Event()
        self.task: asyncio.Task | None = None

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    def _notify(self) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()



class JobStore:
    def __init__(self, options: JobOptions = JobOptions(), clock: Callable[[], float] = time.monotonic):
        options.check()
        self.options, self.clock = options, clock
        self.jobs: dict[str, Job] = {}

    def purge(self) -> None:
        """Forgets the finished jobs whose TTL ran out."""
        now = self.clock()
        for jid in [j.id for j in self.jobs.values()
                    if j.finished_at is not None and now - j.finished_at >= self.options.ttl_s]:
            del self.jobs[jid]

    def reserve(self) -> None:
        """429 when no job can be added."""
        self.purge()
        if len(self.jobs) >= self.options.max_jobs:
            raise ApiError(429, f"{len(self.jobs)} jobs are kept (at most {self.options.max_jobs}); wait for some to "
                           "expire, or delete finished ones", code="too_many_jobs", retry_after=RETRY_AFTER_S)

    def start(self, endpoint: str, prep: Prepared, submit: Callable[[Prepared], GenerationStream]) -> Job:
        self.reserve()
        stream = submit(prep)
        job = Job("job-" + uuid.uuid4().hex, endpoint, prep, stream)
        self.jobs[job.id] = job
        job.task = asyncio.get_running_loop().create_task(self._follow(job))
        return job

    def get(self, job_id: str) -> Job:
        self.purge()
        job = self.jobs.get(job_id)
        if job is None:
            raise ApiError(404, f"no job {job_id!r} (unknown, or its result expired)", param="job_id",
                           code="job_not_found")
        return job

    def cancel(self, job_id: str) -> Job:
        job = self.get(job_id)
        if not job.done:
            job.stream.abort()
            self._end(job, "cancelled")
        return job

    def view(self, job: Job) -> dict[str, Any]:
        """The job as ``GET /v1/jobs/{id}`` reports it (``JobResponse``)."""
        ttl = None if job.finished_at is None else max(0.0, self.options.ttl_s - (self.clock() - job.finished_at))
        return {"id": job.id, "object": "job", "endpoint": job.endpoint, "created": job.created,
                "status": job.status, "progress": job.progress.to_json(),
                "expires_in_s": None if ttl is None else round(ttl, 3), "result": job.result, "error": job.error}

    def _end(self, job: Job, status: str) -> None:
        job.status, job.finished_at = status, self.clock()
        job._notify()

    async def _follow(self, job: Job) -> None:
        """Takes in the job's outputs until it ends: progress, then the result (or the error)."""
        try:
            async for _ in job.stream:
                if job.done:
                    return
                job.progress = job.meter.update(job.stream.latest, self.clock())
                if job.status == "queued":
                    job.status = "running"
                job._notify()
        except Exception as e:  # noqa: BLE001 - reported as the job's error
            job.stream.abort()
            job.error = {"message": f"{type(e).__name__}: {e}", "code": "internal_error"}
            self._end(job, "failed")
            return
        if job.done:
            return
        if job.stream.error:
            job.error = {"message": job.stream.error, "code": job.stream.error_code}
            self._end(job, "failed")
            return
        job.result = job.prep.body(job.stream.request_id, list(job.stream.latest))  # type: ignore[arg-type]
        self._end(job, "succeeded")


async def job_events(store: JobStore, job: Job) -> AsyncIterator[str]:
    """Server-sent events of a job, from its current state on: ``progress`` (the prefill moved),
    ``output`` (new text of each choice: ``{"choices": [{"index", "text"}]}``), then ``end`` (the
    job as ``GET`` reports it) and ``[DONE]``. Text that could still start a stop string is held
    back until the choice finishes, as in streamed completions."""
    stop = job.prep.params.stop or []
    holdback = max((len(s) for s in stop), default=1) - 1
    n = job.prep.params.n
    sent: dict[int, int] = {}
    last: Progress | None = None
    while True:
        changed = job._changed
        if job.progress is not last:
            last = job.progress
            yield _sse("progress", last.to_json())
        deltas = []
        for i, out in enumerate(job.stream.latest):
            for comp in out.outputs if out is not None else ():
                c = i * n + comp.index
                visible = len(comp.text) if comp.finish_reason or job.done else len(comp.text) - holdback
                if visible > sent.get(c, 0):
                    deltas.append({"index": c, "text": comp.text[sent.get(c, 0):visible]})
                    sent[c] = visible
        if deltas:
            yield _sse("output", {"choices": deltas})
        if job.done:
            yield _sse("end", store.view(job)) + "data: [DONE]\n\n"
            return
        await changed.wait()


def _sse(event: str, obj: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
