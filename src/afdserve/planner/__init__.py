"""afdserve.planner: performance model, hardware catalog, plan search and simulator for
disaggregated expert parallelism (MegaScale-Infer §4.1-4.3).  See docs/planner.md.

Public API::

    from afdserve.planner import (
        ModelSpec, load_model_spec, PRESETS,               # models
        GPUSpec, load_catalog,                             # hardware
        Profile, fit, load_profile, save_profile,          # measured constants
        SearchConfig, Plan, search, compare_hetero,        # Algorithm 1
        SimConfig, simulate,                               # discrete-event pipeline simulator
        predict_iteration_time,                            # local runtime prediction
    )
"""

from afdserve.planner.catalog import BUILTIN_GPUS, Catalog, GPUSpec, load_catalog
from afdserve.planner.local import LocalPrediction, predict_iteration_time, predict_local
from afdserve.planner.profile import (
    AttentionCost,
    ExpertCost,
    NetworkProfile,
    Profile,
    UtilCurve,
    WireFormat,
    fit,
    fit_attention,
    fit_expert,
    fit_network,
    load_profile,
    save_profile,
)
from afdserve.planner.roofline import RooflineOptions
from afdserve.planner.search import HeteroComparison, Plan, SearchConfig, SearchResult, compare_hetero, evaluate, search
from afdserve.planner.simulator import SimConfig, SimResult, simulate
from afdserve.planner.spec import PRESETS, MLAConfig, ModelSpec, from_hf_config, load_model_spec

__all__ = [
    "ModelSpec",
    "MLAConfig",
    "PRESETS",
    "from_hf_config",
    "load_model_spec",
    "GPUSpec",
    "Catalog",
    "BUILTIN_GPUS",
    "load_catalog",
    "AttentionCost",
    "ExpertCost",
    "UtilCurve",
    "NetworkProfile",
    "WireFormat",
    "Profile",
    "fit",
    "fit_attention",
    "fit_expert",
    "fit_network",
    "load_profile",
    "save_profile",
    "RooflineOptions",
    "SearchConfig",
    "Plan",
    "SearchResult",
    "HeteroComparison",
    "search",
    "evaluate",
    "compare_hetero",
    "SimConfig",
    "SimResult",
    "simulate",
    "LocalPrediction",
    "predict_local",
    "predict_iteration_time",
]
