"""The offline Python API, in vLLM's shape: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from afdserve.cluster import build_client
from afdserve.config import EngineConfig
from afdserve.engine.client import EngineClient
from afdserve.engine.outputs import RequestOutput
from afdserve.engine.sampling_params import SamplingParams
from afdserve.errors import RequestError, WorkerError

Prompt = str | dict[str, Any]


class LLM:
    """An MoE model served by a deployment: colocated in this process (``expert_workers=0``,
    the default) or disaggregated over worker processes -- on this machine (``cluster="local"``)
    or as Ray actors across nodes (``cluster="ray", ray_address=..., deployment="spec.toml"``;
    docs/ray.md). ``engine`` is the deployment's ``EngineClient``."""

    def __init__(self, model: str | None = None, dtype: str = "float32", **kwargs: Any):
        self._closed = True
        self.config = EngineConfig.from_kwargs(model=model, dtype=dtype, **kwargs)
        self.engine: EngineClient = build_client(self.config)
        self._closed = False

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if self._closed:
            raise RuntimeError("LLM has been shut down")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(params)} sampling params")
        # only the final outputs are returned: none is built per step (as vLLM's LLM does)
        # (one copy of each distinct params object: a single one shared by all prompts is copied once)
        final: dict[int, SamplingParams] = {}
        for p in params:
            if id(p) not in final:
                final[id(p)] = p if p.output_kind == "final_only" else replace(p, output_kind="final_only")
        params = [final[id(p)] for p in params]
        # together: no step starts with the first few; all or none (a refused prompt queues nothing)
        ids = self.engine.add_requests(list(zip(prompts, params)))
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(ids):
                for out in self.engine.get_outputs(timeout=1.0):
                    if out.error:
                        raise WorkerError(f"request {out.request_id} failed: {out.error}")
                    if out.finished:
                        done[out.request_id] = out
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.engine.abort(rid)
            raise
        return [done[r] for r in ids]

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
