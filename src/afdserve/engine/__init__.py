"""The engine: the engine core (scheduler, sampler, runner: token ids in, token ids out), the front
end every deployment shares (prompt validation, detokenization, stop strings, outputs), the
``EngineClient`` interface and the colocated client."""

from afdserve.engine.client import EngineClient, RebalanceResult
from afdserve.engine.outputs import CompletionOutput, RequestOutput, TokenOutput
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.stats import EngineStats

__all__ = ["CompletionOutput", "EngineClient", "EngineStats", "RebalanceResult", "RequestOutput", "SamplingParams",
           "TokenOutput"]
