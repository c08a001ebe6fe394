"""An attention worker: the engine core over the attention half of the model, whose runner is the
ping-pong pipeline to the expert workers (``m`` lanes of steps in flight). It reports new token ids
and finish events only."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from afdserve.backends import host
from afdserve.balance.load import LoadTracker
from afdserve.engine.builder import build_engine, load_attention_side
from afdserve.engine.outputs import TokenOutput
from afdserve.engine.structured_output import XGrammars
from afdserve.kvcache.prefix import PrefixCacheStats
from afdserve.model.config import ModelConfig
from afdserve.model.loader import CheckpointReader
from afdserve.runtime.control import ControlChannel
from afdserve.runtime.cp import CPLinks
from afdserve.runtime.links import Links, PeerFailure, regroup
from afdserve.runtime.kv_transfer import KVReceiver, PrefillRunner, chunk_blocks, kv_links, pd_role
from afdserve.runtime.messages import (AbortRequests, Ack, AddRequest, AddRequests, AdoptKV, AttentionStats, GetStats,
                                       GetTrace, KVReserved, PeerLost, Regroup, ReserveKV, SetMicroBatches, Shutdown,
                                       StatsReply, StepOutputs, SwitchMap, ToWorker, TraceReply, WorkerSpec,
                                       worker_name)
from afdserve.runtime.dispatch import Capacity
from afdserve.runtime.pipeline import PipelinedRunner
from afdserve.runtime.lanes import Lanes
from afdserve.runtime.trace import Tracer, idle_span

# control messages applied only between steps, with nothing in flight
QUIESCENT = (SetMicroBatches, Regroup, SwitchMap)


class AttentionWorker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        cfg = spec.config
        torch.set_num_threads(cfg.num_threads or 1)
        self.tracer = Tracer(spec.name, spec.trace)
        path = Path(spec.model_path)
        model_cfg = ModelConfig.from_pretrained(path)
        self.peers = [worker_name("expert", j) for j in range(spec.expert_map.num_workers)]
        self.hooks = host.join(spec.host_share, "attention", spec.index, cfg.num_threads or 1)  # the backend's
        self.links = Links.connect(spec, peers=self.peers, no_spin=self.hooks.spin_yield)
        side = load_attention_side(cfg, path, model_cfg, CheckpointReader(path))
        tracker = LoadTracker(model_cfg.num_layers, model_cfg.num_experts, cfg.load_window, device=side.model.device) \
            if cfg.gate == "attention" else None
        self.role = pd_role(spec)  # prefill/decode disaggregation: decided here, once
        runner_cls = PrefillRunner if self.role == "prefill" else PipelinedRunner
        self.runner = runner_cls(side.model, side.kv, self.links, spec.expert_map, cfg.micro_batches, cfg.gate,
                                 self.tracer, timeout_s=cfg.comm_timeout_ms / 1000, tracker=tracker, hooks=self.hooks,
                                 capacity=Capacity(cfg.expert_capacity_factor, cfg.on_expert_overflow))
        self.runner.set_map(spec.map_version, spec.expert_map)
        # structured outputs: the tokenizer (and xgrammar) load on the first constrained request
        grammars = XGrammars(cfg.tokenizer or spec.model_path, model_cfg.vocab_size, spec.eos_token_ids)
        self.engine = build_engine(cfg, side, self.runner, set(spec.eos_token_ids), grammars)
        self.kv = side.kv
        self.kv_comm = kv_links(spec, side.kv) if self.role != "mixed" else None
        self.receiver = KVReceiver(self.kv_comm, self.engine, side.kv) if self.role == "decode" else None
        if isinstance(self.runner, PrefillRunner):
            self.runner.transfer(self.kv_comm, chunk_blocks(spec), self.engine)
        self.waiting_for_regroup = False  # a peer was lost: no step until the links are new
        self.epoch = spec.epoch  # membership epoch of the links
        self.held: list[ToWorker] = []  # control messages waiting for no step in flight
        self.lanes = Lanes(self.engine, self.runner, self.tracer, self._emit)
        self._ctl: ControlChannel | None = None
        self.model_cfg = model_cfg
        self.backlog: list[ToWorker] = []  # control messages read during a CP wait, for the loop
        self.cp = CPLinks(spec, model_cfg, self._cp_interrupted, answer=self._answer) \
            if cfg.context_parallel_size > 1 else None
        self.runner.cp = self.cp

    def serve(self, ctl: ControlChannel) -> None:
        eng, lanes = self.engine, self.lanes
        self._ctl = ctl
        while True:
            idle = not lanes.busy and (not eng.has_unfinished() or self.waiting_for_regroup)
            t0 = time.time_ns()
            rx = self.receiver  # a decode worker waits for KV blocks rather than control messages
            expecting = rx is not None and rx.expecting
            if self.backlog or ((idle or ctl.due()) and ctl.poll(0.05 if idle and not expecting else 0)):
                while True:
                    msg = self.backlog.pop(0) if self.backlog else ctl.recv()
                    if isinstance(msg, Shutdown):
                        lanes.abandon()
                        eng.close()  # the prefix cache's disk tier keeps its blocks for the next start
                        return
                    if isinstance(msg, QUIESCENT) and lanes.busy:
                        self.held.append(msg)  # applied once no step is in flight
                    else:
                        self._control(msg, ctl)
                    if not self.backlog and not ctl.poll(0):
                        break
            if self.held and not lanes.busy:
                held, self.held = self.held, []
                for msg in held:
                    self._control(msg, ctl)
            if rx is not None:
                rx.poll(0.02 if idle and expecting else 0.0)
                if rx.adopted:
                    rx.adopted = False
                    lanes.changed()
                self._reserved(rx.retry())
            if idle:
                if self.tracer.enabled and eng.has_unfinished():
                    self.tracer.spans.append(idle_span(t0))
                continue
            try:
                # no new step while a control message waits for the pipeline to drain
                lanes.advance(begin=not self.held, timeout=0.05)
            except PeerFailure as e:  # the steps in flight did not happen: they run again once the links are new
                lanes.abandon()
                self.waiting_for_regroup = True
                ctl.send(PeerLost(self.spec.name, e.peer, str(e), self.epoch))

    def _cp_interrupted(self, handle: int) -> bool:
        """While a CP step waits for its peers: reads the control channel (aborts are applied now, the
        rest waits for the loop) and says whether to drop the step: its request is gone, or the
        membership changed (a ``Regroup`` came: the step runs again on the new links)."""
        ctl = self._ctl
        while ctl is not None and ctl.poll(0):
            msg = ctl.recv()
            if isinstance(msg, AbortRequests):
                self._control(msg, ctl)
            else:
                self.backlog.append(msg)
        if any(isinstance(m, Regroup) for m in self.backlog):  # membership changed: the step runs again after it
            return True
        sched = self.engine.scheduler
        seq = sched.cp_busy
        if seq is not None and seq.cp.handle == handle:
            return seq.finished
        return not any(s.cp.handle == handle for s in sched.sharded)  # a sharded decode step's: still owned

    def _answer(self, handle: int, layer: int, q: torch.Tensor, positions: torch.Tensor):
        """The shard server's (another thread's) answer to a sharded decode step of ``handle``: the
        attention of ``layer``'s queries over the shard held here, or None where none is."""
        eng = self.engine
        with eng.shard_lock:  # (an abort frees the shard's blocks only after this)
            held = eng.shards.get(handle)
            if held is None:
                return None
            slots, pos = held
            return self.runner.model.shard_partial(layer, self.kv, q, positions, torch.from_numpy(slots),
                                                   torch.from_numpy(pos))

    def _reserved(self, replies: list[KVReserved]) -> None:
        for r in replies:
            self._ctl.send(KVReserved(self.spec.name, r.request_id, r.handle, r.skip_blocks, r.attempt))
        if replies:
            self.lanes.changed()

    def _emit(self, outs: list[TokenOutput]) -> None:
        if outs:
            self._ctl.send(StepOutputs(self.spec.name, outs, self._stats()))

    def _control(self, msg: ToWorker, ctl: ControlChannel) -> None:
        name = self.spec.name
        self.lanes.changed()
        if isinstance(msg, (AddRequest, AddRequests)):
            failed = []
            for r in msg.requests if isinstance(msg, AddRequests) else [msg]:
                try:
                    self.engine.add_request(r.request_id, r.prompt_token_ids, r.params, r.output_token_ids, r.cp)
                    if r.kv is not None:  # a prefill worker's: its KV goes to the decode worker
                        self.runner.add(r.request_id, r.kv)
                except Exception as e:  # validated by the front end already; report anyway
                    failed.append(_failed(r.request_id, f"{type(e).__name__}: {e}"))
            if failed:
                ctl.send(StepOutputs(name, failed, self._stats()))
        elif isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                self.engine.abort(rid)
                if self.receiver is not None:
                    self.receiver.abort(rid)  # a reservation (queued, filling or landed)
                elif self.role == "prefill":
                    self.runner.drop(rid)
        elif isinstance(msg, ReserveKV):
            self._reserved(self.receiver.reserve(msg))
        elif isinstance(msg, AdoptKV):
            self.receiver.adopt(msg)
        elif isinstance(msg, GetTrace):
            ctl.send(TraceReply(name, self.tracer.events(msg.tid)))
            self.tracer.spans.clear()
        elif isinstance(msg, GetStats):
            tracker = self.runner.tracker
            ctl.send(StatsReply(name, self._stats(tracker.snapshot().to_json() if tracker is not None else None,
                                                  self.links.transports(), self.engine.prefix_stats(), asked=True)))
        elif isinstance(msg, SetMicroBatches):  # between steps, like SwitchMap
            self.runner.m = msg.m
            ctl.send(Ack(name, msg.m))
        elif isinstance(msg, Regroup):  # membership changed: new links, same weights, caches and requests
            # between steps, like SwitchMap: a resized expert pool's new map; missing expert workers
            self.runner.set_map(msg.map_version if msg.expert_map is not None else self.runner.version,
                                msg.expert_map or self.runner.full_map, msg.missing)
            self.peers = [worker_name("expert", j) for j in range(msg.expert_workers)]
            self.links = self.runner.links = regroup(self.links, self.spec, self.peers, msg, ctl, msg.missing,
                                                       self.hooks.spin_yield)
            if self.cp is not None:  # the CP links anew, after the expert links (the same order everywhere)
                self.cp.close()
                self.cp = self.runner.cp = CPLinks(self.spec, self.model_cfg, self._cp_interrupted, msg.group,
                                                        msg.attention_workers, self._answer)
            if self.kv_comm is not None:  # the KV links anew too, after the expert links (the same order everywhere)
                self.kv_comm.close()
                self.kv_comm = kv_links(self.spec, self.kv, msg.group)
                if self.receiver is not None:
                    self.receiver.regroup(self.kv_comm)
                else:
                    self.runner.regroup(self.kv_comm)
            self.epoch, self.waiting_for_regroup = msg.epoch, False
        elif isinstance(msg, SwitchMap):  # processed between steps, so the whole next step uses the new map
            self.runner.set_map(msg.version, msg.expert_map)  # (never while an expert worker is missing)
            ctl.send(Ack(name, msg.version))
        else:
            raise TypeError(f"{name} got an unexpected message {type(msg).__name__}")

    def _stats(self, load: str | None = None, transports: dict[str, str] | None = None,
               prefix: PrefixCacheStats | None = None, asked: bool = False) -> AttentionStats:
        eng = self.engine
        per_worker, (lost, over, second) = self.runner.counts()
        return AttentionStats(len(eng.scheduler.running), len(eng.scheduler.waiting), eng.blocks.usage,
                              eng.last_step.seconds, eng.last_step.num_tokens, per_worker,
                              load, transports or {}, prefix, lost, over, second, *self._kv_stats(asked),
                              eng.cp_steps, eng.sharded_steps, len(eng.shards))

    def _kv_stats(self, asked: bool) -> tuple[list, int]:
        """A decode worker's transfers since the last ``GetStats`` and the blocks it holds reserved."""
        rx = self.receiver
        if rx is None:
            return [], 0
        landed = list(rx.landed) if asked else []
        if asked:
            rx.landed.clear()
        return landed, rx.reserved_blocks()

    def close(self) -> None:
        self.links.close()
        if self.cp is not None:
            self.cp.close()
        if self.kv_comm is not None:
            self.kv_comm.close()


def _failed(request_id: str, reason: str) -> TokenOutput:
    return TokenOutput(request_id, [], "abort", error=reason)
