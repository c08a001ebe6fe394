"""afdserve: serving Mixture-of-Experts LLMs with disaggregated expert parallelism."""

from afdserve.engine.outputs import CompletionOutput, RequestOutput
from afdserve.engine.sampling_params import SamplingParams
from afdserve.serving.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
