"""An expert worker: this worker's share of the experts of every layer, run once per layer over the
tokens that every attention worker sent (and, with the expert-side gate, the router too)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from afdserve.balance.load import LoadTracker
from afdserve.engine.host_memory import keep_freed_memory
from afdserve.model.config import ModelConfig
from afdserve.model.loader import CheckpointReader, parse_device, parse_dtype
from afdserve.model.model import ExpertModel, load_routers, read_lm_head, regroup_experts
from afdserve.runtime.control import ControlChannel
from afdserve.runtime.core_board import join, lent, slot
from afdserve.runtime.expert_compute import ExpertCompute
from afdserve.runtime.links import Links, PeerFailure, max_micro_batches, regroup
from afdserve.runtime.lm_head import ClaimWords, ExpertLMWork
from afdserve.runtime.messages import (Ack, CommitMap, ExpertStats, GetStats, GetTrace, PeerLost, PrepareMap, Regroup,
                                       Shutdown, StatsReply, ToWorker, TraceReply, WorkerSpec, worker_name)
from afdserve.runtime.trace import Tracer, idle_span


class ExpertWorker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        cfg = spec.config
        torch.set_num_threads(cfg.num_threads or 1)
        keep_freed_memory()
        self.tracer = Tracer(spec.name, spec.trace)
        path = Path(spec.model_path)
        model_cfg = ModelConfig.from_pretrained(path)
        dtype = parse_dtype(cfg.dtype)
        reader = CheckpointReader(path)
        self.device = parse_device(cfg.expert_device or cfg.device)
        held = spec.expert_map.experts_of(spec.index)
        experts = ExpertModel.load(path, held, dtype, model_cfg, reader).to(self.device)
        # JANUS: with the expert-side gate every expert worker computes the same routing
        routers = {layer: r.to(self.device) for layer, r in load_routers(reader, model_cfg, dtype).items()} \
            if cfg.gate == "expert" else None
        tracker = LoadTracker(model_cfg.num_layers, model_cfg.num_experts, cfg.load_window) \
            if cfg.gate == "expert" and spec.index == 0 else None  # every expert worker sees every token
        self.reader = reader
        # an LM head where this worker expects shares of it; read on the first share elsewhere (an
        # attention worker of a deployment spec may run on another device than this config names)
        def load_lm_head() -> torch.Tensor:
            return read_lm_head(reader, model_cfg, dtype).to(self.device)

        lm_head: torch.Tensor | Callable[[], torch.Tensor] | None = None
        if cfg.lm_head_helper_share > 0:
            lm_head = load_lm_head()
        elif cfg.lm_head_share > 0:
            lm_head = load_lm_head
        self.compute = ExpertCompute(experts, routers, spec.index, {spec.map_version: spec.expert_map}, tracker,
                                     lm_head)
        # with a core board, the fused MoE kernel borrows the cores of waiting attention workers, and
        # this worker lends its own while it waits for their next layer (their LM heads borrow them)
        self.lender = join(spec.core_board, "expert", spec.index, cfg.num_threads or 1)
        self.lm_layer = model_cfg.num_layers  # the layer index of LM head jobs
        # LM head jobs of the attention workers, worked on while no layer waits (runtime.lm_head)
        self.lm = ExpertLMWork(self.compute.logits, model_cfg.vocab_size, ClaimWords.of(self.lender),
                               lambda i: self.links.comm.capacity(self.peers[i]) - 64, self.compute.greedy)
        self.busy_ns = 0  # time spent computing, reported with every reply (the senders balance by it)
        self.peers = [worker_name("attention", i) for i in range(cfg.attention_workers)]
        # a deferred replacement connects on its first Regroup (its peers serve around it meanwhile)
        # its waits do not spin on its cores while an attention worker's LM head borrows them
        self.yield_core = self.lender.borrowed if self.lender is not None else None
        self.links: Links | None = None if spec.deferred else Links.connect(spec, peers=self.peers,
                                                                             yield_core=self.yield_core)
        self.waiting_for_regroup = spec.deferred  # a peer was lost: nothing to gather until the links are new
        self.epoch = spec.epoch  # membership epoch of the links

    def serve(self, ctl: ControlChannel) -> None:
        while True:
            t0 = time.time_ns()
            msgs = []
            if not self.waiting_for_regroup and self.links is not None:
                try:
                    # everything each peer has sent: the same layer of several lanes is computed at once
                    msgs = self._gather(wait=not self.lm.jobs)
                except PeerFailure as e:  # a peer died or closed: wait for new links (a Regroup)
                    self._lost(e, ctl)
            links = self.links
            if not msgs or ctl.due():  # while layers keep coming, not every round
                while ctl.poll(0 if not self.waiting_for_regroup else 0.05):
                    msg = ctl.recv()
                    if isinstance(msg, Shutdown):
                        return
                    self._control(msg, ctl)
            if self.links is not links or self.waiting_for_regroup:  # what came over the old links belongs to a
                msgs = []                                            # step that runs again
                self.lm.clear()
            if not msgs and not self.lm.jobs:
                continue
            if msgs and self.tracer.enabled:
                self.tracer.spans.append(idle_span(t0))
            try:
                if msgs:
                    self._round(msgs)
                else:  # no layer waits: the LM head jobs
                    self._lm_work()
            except PeerFailure as e:  # a run's receiver is gone too: wait for new links
                self._lost(e, ctl)

    def _gather(self, wait: bool = True) -> list[tuple[int, Any]]:
        """Everything each peer has sent, waiting (if ``wait``) up to 50 ms for something (its cores
        lent meanwhile)."""
        assert self.links is not None
        limit = max_micro_batches(self.spec.config.micro_batches)
        if self.lender is not None or not wait:
            msgs = self.links.gather(0.0, limit=limit)  # what has come: no lending for nothing
            if msgs or not wait:
                return msgs
        with lent(self.lender):
            return self.links.gather(0.05, limit=limit)

    def _lost(self, e: PeerFailure, ctl: ControlChannel) -> None:
        self.waiting_for_regroup = True
        ctl.send(PeerLost(self.spec.name, e.peer, str(e), self.epoch))

    def _control(self, msg: ToWorker, ctl: ControlChannel) -> None:
        c, name = self.compute, self.spec.name
        if isinstance(msg, GetTrace):
            ctl.send(TraceReply(name, self.tracer.events(msg.tid)))
            self.tracer.spans.clear()
        elif isinstance(msg, GetStats):
            load = c.tracker.snapshot().to_json() if c.tracker is not None else None
            ctl.send(StatsReply(name, ExpertStats(c.tokens_per_expert.tolist(),
                                                  [list(p.expert_ids) for p in c.experts.layers], load,
                                                  self.links.transports() if self.links is not None else {})))
        elif isinstance(msg, Regroup):  # membership changed: new links, same experts unless the map changed
            if msg.expert_map is not None:  # the expert pool was resized: hold this worker's share of the new map
                held = msg.expert_map.experts_of(self.spec.index)
                c.experts = regroup_experts(c.experts, held, self.reader).to(self.device)
                c.maps = {msg.map_version: msg.expert_map}
            self.peers = [worker_name("attention", i) for i in range(msg.attention_workers)]
            self.links = regroup(self.links, self.spec, self.peers, msg, ctl, yield_core=self.yield_core)
            self.epoch, self.waiting_for_regroup = msg.epoch, False
        elif isinstance(msg, PrepareMap):  # hold the union of the current and the new map's experts
            cur = [set(p.expert_ids) for p in c.experts.layers]
            union = [sorted(a | set(b)) for a, b in zip(cur, msg.expert_map.experts_of(self.spec.index))]
            c.experts = regroup_experts(c.experts, union, self.reader).to(self.device)
            c.maps[msg.version] = msg.expert_map
            ctl.send(Ack(name, msg.version))
        elif isinstance(msg, CommitMap):  # every attention worker uses the new map: drop what it doesn't need
            keep = c.maps[msg.version]
            c.experts = regroup_experts(c.experts, keep.experts_of(self.spec.index), self.reader).to(self.device)
            c.maps = {msg.version: keep}
            ctl.send(Ack(name, msg.version))
        else:
            raise TypeError(f"{name} got an unexpected message {type(msg).__name__}")

    def _round(self, msgs: list[tuple[int, Any]]) -> None:
        """The messages that came (several per attention worker: its lanes); the tokens of the same
        layer are computed at once, and each sender gets its part back."""
        assert self.links is not None  # messages came over them
        by_layer: dict[tuple[int, int], list[tuple[int, Any]]] = {}
        for i, msg in msgs:  # merged per (layer, map version)
            by_layer.setdefault((msg.meta.layer, msg.meta.tag), []).append((i, msg))
        for (layer, _), group in by_layer.items():
            t0 = time.perf_counter_ns()
            if layer == self.lm_layer:  # LM head jobs: worked on once no layer waits
                for i, m in group:
                    self.lm.add(i, m.meta.step, m.meta.microbatch, layer, m.meta.ints, m.tensors[0])
                    m.release()
                continue
            mbs = sorted({m.meta.microbatch for _, m in group})
            with self.tracer.span("expert", layer=layer, mb=mbs[0] if len(mbs) == 1 else str(mbs),
                                  tokens=sum(m.tensors[0].shape[0] for _, m in group), senders=len(group)):
                outs = self.compute.run(layer, [m.tensors for _, m in group], group[0][1].meta.tag)
            self._reply(group, outs, layer, t0)

    def _lm_work(self) -> None:
        """Pieces of the oldest LM head job until a message comes or the job has no blocks left."""
        assert self.links is not None
        links, t0 = self.links, time.perf_counter_ns()

        def send(i: int, tensors: list[torch.Tensor], meta: tuple[int, int, int, int], a: int, b: int) -> None:
            if self.lender is not None:
                self.lender.wake(slot("attention", i))
            links.send(i, tensors, meta, ((self.busy_ns + time.perf_counter_ns() - t0) // 1000, a, b))

        with self.tracer.span("expert", layer=self.lm_layer, phase="lm_head"):
            self.lm.work(links.pending, send)
        self.busy_ns += time.perf_counter_ns() - t0

    def _reply(self, group: list[tuple[int, Any]], outs: list[torch.Tensor], layer: int, t0: int) -> None:
        assert self.links is not None
        self.busy_ns += time.perf_counter_ns() - t0
        with self.tracer.span("send", layer=layer):
            for (i, msg), out in zip(group, outs):
                if self.lender is not None:
                    self.lender.wake(slot("attention", i))
                meta = msg.meta
                msg.release()
                self.links.send(i, [out], (meta.step, meta.microbatch, layer, 0), (self.busy_ns // 1000,))

    def close(self) -> None:
        if self.links is not None:
            self.links.close()
