"""Where the search takes k1..k4 and Util from: a profile, the roofline estimate, or both."""

from __future__ import annotations

from afdserve.planner import roofline
from afdserve.planner.catalog import GPUSpec
from afdserve.planner.costs import AttentionCost, ExpertCost, UtilCurve
from afdserve.planner.profile import Profile
from afdserve.planner.search_config import SearchConfig
from afdserve.planner.spec import ModelSpec

__all__ = ["CostSource"]


class CostSource:
    """Where k1..k4 and Util come from: a profile, the roofline, or both (see SearchConfig)."""

    def __init__(self, spec: ModelSpec, config: SearchConfig, profile: Profile | None = None) -> None:
        self.spec = spec
        self.config = config
        self.profile = profile
        self.used: set[str] = set()

    @property
    def fallback(self) -> bool:
        return self.profile is None or self.config.allow_roofline_fallback

    def attention(self, gpu: GPUSpec, tp: int) -> AttentionCost | None:
        if self.profile is not None:
            c = self.profile.attention_cost(gpu.name, tp)
            if c is not None:
                self.used.add("profile")
                return c
        if not self.fallback:
            return None
        self.used.add("roofline-estimate")
        return roofline.attention_cost(self.spec, gpu, tp, self.config.roofline)

    def expert(self, gpu: GPUSpec, tp: int, experts_per_node: int) -> ExpertCost | None:
        if self.profile is not None:
            c = self.profile.expert_cost(gpu.name, tp, experts_per_node)
            if c is not None:
                self.used.add("profile")
                return c
        if not self.fallback:
            return None
        self.used.add("roofline-estimate")
        return roofline.expert_cost(self.spec, gpu, tp, experts_per_node, self.config.roofline)

    def util(self, gpu: GPUSpec) -> UtilCurve:
        if self.profile is not None and self.profile.network is not None:
            return self.profile.network.util_curve()
        lat = self.config.link_latency_s
        return UtilCurve(peak=1.0, half_bytes=lat * gpu.net_Bps)

    def label(self, att: AttentionCost, exp: ExpertCost) -> str:
        from_profile = [
            self.profile is not None and any(c is att for c in self.profile.attention),
            self.profile is not None and any(c is exp for c in self.profile.expert),
        ]
        if all(from_profile):
            return "profile"
        return "profile+roofline" if any(from_profile) else "roofline-estimate"
