"""The disaggregated runtime: attention and expert workers, the ping-pong pipeline between them,
their M2N links, expert maps and traces. What other packages may use is listed here."""

from afdserve.runtime.control import ControlChannel
from afdserve.runtime.data_plane import ExpertInput, ExpertOutput, Kind, LayerKey
from afdserve.runtime.expert_compute import ExpertCompute
from afdserve.runtime.expert_map import ExpertMap
from afdserve.runtime.links import Links, PeerFailure
from afdserve.runtime.messages import AttentionStats, StepOutputs
from afdserve.runtime.pipeline import Dispatch, PipelinedRunner
from afdserve.runtime.trace import Span, Tracer

__all__ = ["AttentionStats", "ControlChannel", "Dispatch", "ExpertCompute", "ExpertInput", "ExpertMap", "ExpertOutput",
           "Kind", "LayerKey", "Links", "PeerFailure", "PipelinedRunner", "Span", "StepOutputs", "Tracer"]
