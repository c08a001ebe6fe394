"""afdserve: serving Mixture-of-Experts LLMs with disaggregated expert parallelism."""

import os

# OpenMP threads (torch's libgomp) spin ~300,000 times after a parallel region by default: where
# another process takes a core, a spinning thread holds it while the thread with the work waits for
# a time slice, and a step takes tens of times longer (``benchmarks/decode.py --busy``). Read once,
# when libgomp loads: effective where afdserve is imported before torch (the CLI, its workers,
# ``from afdserve import LLM`` first); a value set by the user is kept.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

from afdserve.engine.outputs import CompletionOutput, RequestOutput
from afdserve.engine.sampling_params import SamplingParams
from afdserve.serving.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
