"""afdserve.planner: performance model, hardware catalog, plan search and simulators for
disaggregated expert parallelism (MegaScale-Infer §4.1-4.3).  See docs/planner.md.

A library of small public functions; it measures nothing (``afdserve.profiling`` does) and runs no
part of the runtime.  Public API::

    from afdserve.planner import (
        ModelSpec, load_model_spec, from_model_config, PRESETS,  # models
        GPUSpec, load_catalog,                                   # hardware
        Profile, fit, load_profile, save_profile,                # measured constants
        SearchConfig, Plan, search, compare_hetero,              # Algorithm 1
        AltConfig, compare_families,                             # AFD vs wide EP vs TP, and why
        SimConfig, simulate,                                     # discrete-event pipeline simulator
        predict_iteration_time,                                  # local runtime prediction
        attention_request_cost,                                  # the attention balancer's cost
    )
"""

from afdserve.planner.alternatives import AltConfig, FamilyPlan
from afdserve.planner.catalog import BUILTIN_GPUS, Catalog, GPUSpec, load_catalog
from afdserve.planner.costs import AttentionCost, ExpertCost, NetworkProfile, RuntimeCosts, UtilCurve, WireFormat
from afdserve.planner.fitting import (
    TransportSamples,
    fit,
    fit_affine,
    fit_attention,
    fit_expert,
    fit_network,
    fit_nondecreasing,
    fit_runtime,
)
from afdserve.planner.local import LocalPrediction, predict_iteration_time, predict_local
from afdserve.planner.plan import Plan
from afdserve.planner.presets import PRESETS
from afdserve.planner.profile import Profile, attention_request_cost, load_profile, save_profile
from afdserve.planner.report import profile_summary
from afdserve.planner.roofline import RooflineOptions
from afdserve.planner.search import HeteroComparison, SearchResult, compare_hetero, evaluate, search
from afdserve.planner.search_config import SearchConfig
from afdserve.planner.simulator import SimConfig, SimResult, simulate
from afdserve.planner.spec import MLAConfig, ModelSpec
from afdserve.planner.spec_loader import from_hf_config, from_model_config, load_model_spec
from afdserve.planner.verdict import Comparison, compare_families

__all__ = [
    "ModelSpec",
    "MLAConfig",
    "PRESETS",
    "from_hf_config",
    "from_model_config",
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
    "RuntimeCosts",
    "Profile",
    "TransportSamples",
    "fit",
    "fit_affine",
    "fit_attention",
    "fit_expert",
    "fit_network",
    "fit_nondecreasing",
    "fit_runtime",
    "load_profile",
    "save_profile",
    "attention_request_cost",
    "profile_summary",
    "RooflineOptions",
    "SearchConfig",
    "Plan",
    "SearchResult",
    "HeteroComparison",
    "search",
    "evaluate",
    "compare_hetero",
    "AltConfig",
    "FamilyPlan",
    "Comparison",
    "compare_families",
    "SimConfig",
    "SimResult",
    "simulate",
    "LocalPrediction",
    "predict_local",
    "predict_iteration_time",
]
