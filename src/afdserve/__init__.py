"""afdserve: serving Mixture-of-Experts LLMs with disaggregated expert parallelism."""

from afdserve.engine.llm import LLM
from afdserve.engine.outputs import CompletionOutput, RequestOutput
from afdserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
