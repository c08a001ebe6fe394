"""The routes of async jobs (``afdserve.serving.jobs``): ``POST /v1/jobs``, ``GET /v1/jobs/{id}``,
``GET /v1/jobs/{id}/events``, ``DELETE /v1/jobs/{id}``, and their request and response models."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Discriminator, Tag

from afdserve.serving.errors import ApiError
from afdserve.serving.generation import OpenAIServing
from afdserve.serving.jobs import JobStore, job_events
from afdserve.serving.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                       CompletionResponse, ErrorResponse)


def _kind(body: Any) -> str:
    return "ChatCompletionRequest" if isinstance(body, dict) and "messages" in body else "CompletionRequest"


#: The body of a completions or a chat request (told apart by ``messages``), without ``stream``.
JobRequest = Annotated[Annotated[CompletionRequest, Tag("CompletionRequest")]
                       | Annotated[ChatCompletionRequest, Tag("ChatCompletionRequest")], Discriminator(_kind)]


class JobProgress(BaseModel):
    prompt_tokens_done: int  # prompt tokens computed so far (cached ones included)
    prompt_tokens_total: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    tokens_per_second: float | None  # the prefill's rate since its first report
    eta_seconds: float | None  # the prefill's time left at that rate (0 once done)


class JobError(BaseModel):
    message: str
    code: str | None = None


class JobResponse(BaseModel):
    id: str
    object: Literal["job"]
    endpoint: Literal["/v1/completions", "/v1/chat/completions"]
    created: int
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    progress: JobProgress
    expires_in_s: float | None  # seconds until a finished job is forgotten
    result: CompletionResponse | ChatCompletionResponse | None  # the non-streaming response, once succeeded
    error: JobError | None


_ERR = {"model": ErrorResponse}
_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: _ERR | {"description": "no such job (or it expired)"}}


def jobs_router(serving: OpenAIServing, store: JobStore) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/jobs", status_code=202, response_model=JobResponse,
                 responses={400: _ERR | {"description": "invalid request"},
                            413: _ERR | {"description": "the body is larger than the server accepts"},
                            429: _ERR | {"description": "too many jobs kept, or the server is overloaded"},
                            503: _ERR | {"description": "the deployment failed or is shutting down"}})
    async def create_job(body: JobRequest) -> JSONResponse:
        """Submits a completions or chat request as a job and answers at once (202)."""
        if body.stream:
            raise ApiError(400, "a job is not streamed: follow it with GET /v1/jobs/{id}/events", param="stream",
                           code="invalid_value")
        store.reserve()  # before tokenizing a long prompt for nothing
        if isinstance(body, ChatCompletionRequest):
            endpoint, prep = "/v1/chat/completions", await serving.prepare_chat(body)
        else:
            endpoint, prep = "/v1/completions", await serving.prepare_completion(body)
        job = store.start(endpoint, prep, serving.submit)
        return JSONResponse(store.view(job), status_code=202)

    @router.get("/v1/jobs/{job_id}", response_model=JobResponse, responses=_NOT_FOUND)
    async def get_job(job_id: str) -> JSONResponse:
        """The job's status, prefill progress and, once it succeeded, its result."""
        return JSONResponse(store.view(store.get(job_id)))

    @router.get("/v1/jobs/{job_id}/events", response_class=StreamingResponse,
                responses=_NOT_FOUND | {200: {"content": {"text/event-stream": {}},
                                              "description": "events progress, output, end; then [DONE]"}})
    async def job_events_route(job_id: str) -> StreamingResponse:
        """Server-sent events: the prefill's progress, output text as it is generated, the end."""
        job = store.get(job_id)
        return StreamingResponse(job_events(store, job), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @router.delete("/v1/jobs/{job_id}", response_model=JobResponse, responses=_NOT_FOUND)
    async def cancel_job(job_id: str) -> JSONResponse:
        """Cancels the job (its work stops at the next engine step; a finished job is unchanged)."""
        return JSONResponse(store.view(store.cancel(job_id)))

    return router
