"""An expert worker: this worker's share of the experts of every layer, run once per layer over the
tokens that every attention worker sent (and, with the expert-side gate, the router too)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from afdserve.backends import host
from afdserve.balance.load import LoadTracker
from afdserve.engine.builder import engine_backends
from afdserve.engine.host_memory import keep_freed_memory
from afdserve.model.config import ModelConfig
from afdserve.model.loader import CheckpointReader, parse_device, parse_dtype
from afdserve.model.model import ExpertModel, load_routers, regroup_experts
from afdserve.runtime.control import ControlChannel
from afdserve.runtime.data_plane import ExpertInput, ExpertOutput, read
from afdserve.runtime.expert_compute import ExpertCompute
from afdserve.runtime.links import Links, PeerFailure, max_micro_batches, regroup
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
        backends = engine_backends(cfg, self.device, dtype, model_cfg)
        held = spec.expert_map.experts_of(spec.index)
        experts = ExpertModel.load(path, held, dtype, model_cfg, reader).to(self.device).prepare(backends)
        # JANUS: with the expert-side gate every expert worker computes the same routing
        routers = None
        if cfg.gate == "expert":
            routers = {layer: r.to(self.device) for layer, r in load_routers(reader, model_cfg, dtype).items()}
            for r in routers.values():
                r.prepare(backends)
        tracker = LoadTracker(model_cfg.num_layers, model_cfg.num_experts, cfg.load_window, device=self.device) \
            if cfg.gate == "expert" and spec.index == 0 else None  # every expert worker sees every token
        self.reader = reader
        self.compute = ExpertCompute(experts, routers, spec.index, {spec.map_version: spec.expert_map}, tracker)
        self.hooks = host.join(spec.host_share, "expert", spec.index, cfg.num_threads or 1)  # the backend's
        self.peers = [worker_name("attention", i) for i in range(cfg.attention_workers)]
        # a deferred replacement connects on its first Regroup (its peers serve around it meanwhile)
        self.links: Links | None = None if spec.deferred else Links.connect(spec, peers=self.peers,
                                                                             no_spin=self.hooks.spin_yield)
        self.waiting_for_regroup = spec.deferred  # a peer was lost: nothing to gather until the links are new
        self.epoch = spec.epoch  # membership epoch of the links

    def serve(self, ctl: ControlChannel) -> None:
        while True:
            t0 = time.time_ns()
            msgs = []
            if not self.waiting_for_regroup and self.links is not None:
                try:
                    # everything each peer has sent: the same layer of several lanes is computed at once
                    msgs = self._gather()
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
            if not msgs:
                continue
            if self.tracer.enabled:
                self.tracer.spans.append(idle_span(t0))
            try:
                self._round([(i, read(m)) for i, m in msgs])
            except PeerFailure as e:  # a reply's receiver is gone too: wait for new links
                self._lost(e, ctl)

    def _gather(self) -> list:
        """Everything each peer has sent, waiting up to 50 ms for something (within the backend's
        ``waiting`` hook only once nothing has come)."""
        assert self.links is not None
        limit = max_micro_batches(self.spec.config.micro_batches)
        msgs = self.links.gather(0.0, limit=limit)
        if msgs:
            return msgs
        with self.hooks.waiting():
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
                c.experts = regroup_experts(c.experts, held, self.reader)
                c.maps = {msg.map_version: msg.expert_map}
            self.peers = [worker_name("attention", i) for i in range(msg.attention_workers)]
            self.links = regroup(self.links, self.spec, self.peers, msg, ctl, no_spin=self.hooks.spin_yield)
            self.epoch, self.waiting_for_regroup = msg.epoch, False
        elif isinstance(msg, PrepareMap):  # hold the union of the current and the new map's experts
            cur = [set(p.expert_ids) for p in c.experts.layers]
            union = [sorted(a | set(b)) for a, b in zip(cur, msg.expert_map.experts_of(self.spec.index))]
            c.experts = regroup_experts(c.experts, union, self.reader)
            c.maps[msg.version] = msg.expert_map
            ctl.send(Ack(name, msg.version))
        elif isinstance(msg, CommitMap):  # every attention worker uses the new map: drop what it doesn't need
            keep = c.maps[msg.version]
            c.experts = regroup_experts(c.experts, keep.experts_of(self.spec.index), self.reader)
            c.maps = {msg.version: keep}
            ctl.send(Ack(name, msg.version))
        else:
            raise TypeError(f"{name} got an unexpected message {type(msg).__name__}")

    def _round(self, msgs: list[tuple[int, ExpertInput]]) -> None:
        """The inputs that came (several per attention worker: its lanes); the tokens of the same
        layer are computed at once, and each sender gets its part back."""
        assert self.links is not None  # messages came over them
        by_layer: dict[tuple[int, int], list[tuple[int, ExpertInput]]] = {}
        for i, inp in msgs:  # merged per (layer, map version)
            if not isinstance(inp, ExpertInput):
                inp.release()
                raise RuntimeError(f"{self.spec.name} got {type(inp).__name__} from attention worker {i}")
            by_layer.setdefault((inp.key.layer, inp.map_version), []).append((i, inp))
        for (layer, _), group in by_layer.items():
            lanes = sorted({inp.key.lane for _, inp in group})
            with self.tracer.span("expert", layer=layer, mb=lanes[0] if len(lanes) == 1 else str(lanes),
                                  tokens=sum(inp.hidden.shape[0] for _, inp in group), senders=len(group)):
                outs = self.compute.run(layer, [inp for _, inp in group])
            with self.tracer.span("send", layer=layer):
                for (i, inp), out in zip(group, outs):
                    self.hooks.sending("attention", i)
                    inp.release()
                    self.links.send(i, ExpertOutput(inp.key, out))

    def close(self) -> None:
        if self.links is not None:
            self.links.close()
