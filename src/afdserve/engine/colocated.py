"""The colocated deployment as an ``EngineClient``: the engine core, with every expert, runs in the
caller's thread; ``get_outputs`` runs one step."""

from __future__ import annotations

import time

from afdserve.balance.load import LoadSnapshot
from afdserve.balance.placement import Placement
from afdserve.config import EngineConfig
from afdserve.engine.client import RebalanceResult, ScaleResult
from afdserve.engine.engine import Engine
from afdserve.engine.frontend import FrontEnd
from afdserve.engine.outputs import TokenOutput
from afdserve.engine.runner import LocalExperts
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.stats import BusyMeter, EngineStats
from afdserve.engine.tokenizer import TokenizerInfo
from afdserve.errors import ConfigError
from afdserve.kvcache.prefix import PrefixCacheStats

NAME = "engine"  # the one worker this deployment reports on


class ColocatedClient(FrontEnd):
    def __init__(self, cfg: EngineConfig, engine: Engine, tokenizer: TokenizerInfo | None, experts: LocalExperts):
        super().__init__(tokenizer, engine.runner.vocab_size, engine.max_model_len)
        self.config, self.engine, self.experts = cfg, engine, experts
        self.failed: str | None = None
        self._busy = 0.0
        self._meter = BusyMeter()
        self._load: LoadSnapshot | None = None
        self._expert_tokens: list[list[int]] = []
        self._sizes: list[int] = []
        self._prefix: dict[str, PrefixCacheStats] = {}

    # ---- FrontEnd: the engine core in this thread ---------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.add_request(request_id, prompt_token_ids, params)

    def cancel(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def poll(self, timeout: float) -> list[TokenOutput]:
        if not self.engine.has_unfinished():
            return []
        t0 = time.perf_counter()
        outs = self.engine.step()
        tokens = self.engine.last_step.num_tokens
        if tokens:
            self._busy += time.perf_counter() - t0
            self._sizes.append(tokens)
        return outs

    # ---- stats and control --------------------------------------------------------------------
    def stats(self) -> EngineStats:
        sched = self.engine.scheduler
        sizes, self._sizes = self._sizes, []
        return EngineStats(running=len(sched.running), waiting=len(sched.waiting),
                           kv_usage={NAME: self.engine.blocks.usage}, expert_tokens=self._expert_tokens,
                           busy_seconds={NAME: self._busy}, busy_fraction=dict(self._meter.fraction),
                           expert_load=self._load, micro_batch_sizes=sizes, prefix_cache=self._prefix)

    def refresh_stats(self) -> None:
        self._meter.update({NAME: self._busy}, time.monotonic())
        self._load = self.experts.tracker.snapshot()
        self._expert_tokens = self.experts.counts.tolist()
        self._prefix = {NAME: self.engine.prefix_stats()}

    def expert_load(self) -> LoadSnapshot | None:
        return self.experts.tracker.snapshot()

    def rebalance(self, slots_per_worker: int | None = None, planner: str = "janus",
                  placement: Placement | None = None) -> RebalanceResult:
        raise ConfigError("this deployment has no expert workers to rebalance (expert_workers=0)")

    def scale(self, attention_workers: int | None = None, expert_workers: int | None = None) -> ScaleResult:
        raise ConfigError("the colocated engine (expert_workers=0) has no worker pools to resize")

    def set_micro_batches(self, m: int) -> None:
        if m != 1:
            raise ConfigError(f"invalid micro_batches={m}: the colocated engine runs whole batches (expert_workers=0)")

    def shutdown(self) -> None:
        self.engine.close()  # the prefix cache's disk tier keeps its blocks for the next start
