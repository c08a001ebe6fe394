"""The two worker roles. Each is a plain class with a ``serve`` loop driven by a control channel,
so the same classes run as local processes (``runtime.cluster``) or as Ray actors.

Attention worker: holds the attention weights and the KV cache of its own requests, runs its
share of the scheduler and the router, and drives the ping-pong pipeline.
Expert worker: holds its experts of every layer; gathers each layer's tokens from all attention
workers, runs each expert once over them and sends the partial sums back.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from afdserve.config import EngineConfig
from afdserve.engine.builder import build_attention_engine
from afdserve.engine.outputs import CompletionOutput, RequestOutput
from afdserve.runtime.deltas import DeltaEncoder
from afdserve.model.config import ModelConfig
from afdserve.model.loader import CheckpointReader, parse_dtype
from afdserve.balance.load import LoadTracker
from afdserve.model.model import ExpertModel, _moe_prefix, regroup_experts
from afdserve.model.router import Router
from afdserve.runtime.expert_compute import ExpertCompute
from afdserve.runtime.expert_map import ExpertMap
from afdserve.comm import PeerClosedError
from afdserve.runtime.links import Links, PeerFailure
from afdserve.runtime.pipeline import PipelinedRunner
from afdserve.runtime.trace import Tracer


class Control(Protocol):
    """The control channel to the front end (a multiprocessing Connection locally)."""

    def send(self, obj: Any) -> None: ...
    def recv(self) -> Any: ...
    def poll(self, timeout: float = 0.0) -> bool: ...


@dataclass
class WorkerSpec:
    role: str  # "attention" | "expert"
    index: int
    config: EngineConfig
    model_path: str
    expert_map: ExpertMap
    store: tuple[str, int]  # rendezvous store of the deployment's M2N group
    group: str  # unique name of this deployment (shared-memory names, store keys)
    trace: bool = False
    comm: dict = field(default_factory=dict)  # CommConfig overrides

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"


def attention_name(i: int) -> str:
    return f"attention{i}"


def expert_name(j: int) -> str:
    return f"expert{j}"


class AttentionWorker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        cfg = spec.config
        torch.set_num_threads(cfg.num_threads or 1)
        self.tracer = Tracer(spec.name, spec.trace)
        path = Path(spec.model_path)
        model_cfg = ModelConfig.from_pretrained(path)
        self.links = Links.connect(spec, peers=[expert_name(j) for j in range(spec.expert_map.num_workers)])
        self.engine = build_attention_engine(cfg, path, model_cfg, moe=lambda *a: None)  # runner replaced below
        base = self.engine.runner
        tracker = LoadTracker(model_cfg.num_layers, model_cfg.num_experts, cfg.load_window) \
            if cfg.gate == "attention" else None
        self.runner = PipelinedRunner(base.model, base.kv, self.links, spec.expert_map, cfg.micro_batches, cfg.gate,
                                      self.tracer, timeout_s=cfg.comm_timeout_ms / 1000, tracker=tracker)
        self.engine.runner = self.runner
        self.failed: str | None = None
        self.deltas = DeltaEncoder()

    def _send_outputs(self, ctl: Control, outs: list[RequestOutput]) -> None:
        ctl.send(("out", self.deltas.encode(outs), self._stats()))

    def serve(self, ctl: Control) -> None:
        ctl.send(("ready", self.spec.name, os.getpid()))
        eng = self.engine
        while True:
            idle = not eng.has_unfinished()
            t0 = time.time_ns()
            if ctl.poll(0.05 if idle else 0):
                while True:
                    msg = ctl.recv()
                    if msg[0] == "stop":
                        return
                    self._control(msg, ctl)
                    if not ctl.poll(0):
                        break
            if idle:
                if self.tracer.enabled and eng.has_unfinished():
                    self.tracer.spans.append(_idle_span(t0))
                continue
            try:
                with self.tracer.span("step", step=self.runner.step_no + 1, m=self.runner.m) as span:
                    outs = eng.step()
                    span["tokens"] = eng.last_step.num_tokens
            except PeerFailure as e:
                self._fail_all(str(e), ctl)
                continue
            if outs:
                self._send_outputs(ctl, outs)

    def _control(self, msg: tuple, ctl: Control) -> None:
        kind = msg[0]
        if kind == "add":
            _, rid, ids, text, params = msg
            if self.failed:
                self._send_outputs(ctl, [_failed_output(rid, text, ids, self.failed)])
                return
            try:
                self.engine.add_request({"prompt_token_ids": ids, "prompt": text}, params, request_id=rid)
            except Exception as e:  # validated by the front end already; report anyway
                self._send_outputs(ctl, [_failed_output(rid, text, ids, f"{type(e).__name__}: {e}")])
        elif kind == "abort":
            self.engine.abort(msg[1])
        elif kind == "trace":
            ctl.send(("trace", self.spec.name, self.tracer.events(msg[1])))
            self.tracer.spans.clear()
        elif kind == "stats":
            st = self._stats()
            if self.runner.tracker is not None:
                st["load"] = self.runner.tracker.snapshot().to_json()
            st["transports"] = _transports(self.links)
            ctl.send(("stats", self.spec.name, st))
        elif kind == "set_micro_batches":  # between steps, like set_map
            self.runner.m = msg[1]
            ctl.send(("ack", self.spec.name, msg[1]))
        elif kind == "set_map":  # processed between steps, so the whole next step uses the new map
            self.runner.set_map(msg[1], msg[2])
            ctl.send(("ack", self.spec.name, msg[1]))

    def _stats(self) -> dict:
        eng = self.engine
        return {"running": len(eng.scheduler.running), "waiting": len(eng.scheduler.waiting),
                "kv_usage": eng.blocks.usage, "step_s": eng.last_step.seconds, "step_tokens": eng.last_step.num_tokens,
                "tokens_per_expert_worker": self.runner.tokens_per_worker.tolist()}

    def _fail_all(self, reason: str, ctl: Control) -> None:
        self.failed = reason
        outs = []
        for rid in list(self.engine.seqs):
            out = self.engine.abort(rid)
            if out is not None:
                out.error = reason
                outs.append(out)
        ctl.send(("failed", self.spec.name, reason))
        if outs:
            self._send_outputs(ctl, outs)

    def close(self) -> None:
        self.links.close()


class ExpertWorker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        cfg = spec.config
        torch.set_num_threads(cfg.num_threads or 1)
        self.tracer = Tracer(spec.name, spec.trace)
        path = Path(spec.model_path)
        model_cfg = ModelConfig.from_pretrained(path)
        dtype = parse_dtype(cfg.dtype)
        reader = CheckpointReader(path)
        experts = ExpertModel.load(path, spec.expert_map.experts_of(spec.index), dtype, model_cfg, reader)
        routers = None
        if cfg.gate == "expert":  # JANUS: every expert worker computes the same gate
            routers = [Router(model_cfg, dtype) for _ in range(model_cfg.num_layers)]
            for layer, r in enumerate(routers):
                r.weight.copy_(reader.get(_moe_prefix(model_cfg, layer, reader) + ".gate.weight",
                                          (model_cfg.num_experts, model_cfg.hidden_size), dtype))
        tracker = LoadTracker(model_cfg.num_layers, model_cfg.num_experts, cfg.load_window) \
            if cfg.gate == "expert" and spec.index == 0 else None  # every expert worker sees every token
        self.reader = reader
        self.compute = ExpertCompute(experts, routers, spec.index, {0: spec.expert_map}, tracker)
        self.peers = [attention_name(i) for i in range(cfg.attention_workers)]
        self.links = Links.connect(spec, peers=self.peers)

    def serve(self, ctl: Control) -> None:
        ctl.send(("ready", self.spec.name, os.getpid()))
        while True:
            t0 = time.time_ns()
            try:
                msgs = self.links.gather(0.05)
            except PeerFailure as e:
                if isinstance(e, PeerClosedError):  # an attention worker shut down first
                    msgs = []
                else:
                    ctl.send(("failed", self.spec.name, str(e)))
                    return
            while ctl.poll(0):
                msg = ctl.recv()
                if msg[0] == "stop":
                    return
                self._control(msg, ctl)
            if not msgs:
                continue
            if self.tracer.enabled:
                self.tracer.spans.append(_idle_span(t0))
            try:
                self._round(msgs)
            except PeerFailure as e:
                ctl.send(("failed", self.spec.name, str(e)))
                return

    def _control(self, msg: tuple, ctl: Control) -> None:
        kind, c = msg[0], self.compute
        if kind == "trace":
            ctl.send(("trace", self.spec.name, self.tracer.events(msg[1])))
            self.tracer.spans.clear()
        elif kind == "stats":
            st: dict = {"tokens_per_expert": c.tokens_per_expert.tolist(),
                        "experts": [list(p.expert_ids) for p in c.experts.layers]}
            if c.tracker is not None:
                st["load"] = c.tracker.snapshot().to_json()
            st["transports"] = _transports(self.links)
            ctl.send(("stats", self.spec.name, st))
        elif kind == "prepare":  # hold the union of the current and the new map's experts
            version, new_map = msg[1], msg[2]
            cur = [set(p.expert_ids) for p in c.experts.layers]
            union = [sorted(a | set(b)) for a, b in zip(cur, new_map.experts_of(self.spec.index))]
            c.experts = regroup_experts(c.experts, union, self.reader)
            c.maps[version] = new_map
            ctl.send(("ack", self.spec.name, version))
        elif kind == "commit":  # every attention worker uses the new map: drop what it doesn't need
            version = msg[1]
            keep = c.maps[version]
            c.experts = regroup_experts(c.experts, keep.experts_of(self.spec.index), self.reader)
            c.maps = {version: keep}
            ctl.send(("ack", self.spec.name, version))

    def _round(self, msgs: list[tuple[int, Any]]) -> None:
        """One message from each attention worker that sent one; tokens of a layer are merged."""
        by_layer: dict[tuple[int, int], list[tuple[int, Any]]] = {}
        for i, msg in msgs:  # merged per (layer, map version)
            by_layer.setdefault((msg.meta.layer, msg.meta.tag), []).append((i, msg))
        for (layer, _), group in by_layer.items():
            mbs = sorted({m.meta.microbatch for _, m in group})
            with self.tracer.span("expert", layer=layer, mb=mbs[0] if len(mbs) == 1 else str(mbs),
                                  tokens=sum(m.tensors[0].shape[0] for _, m in group), senders=len(group)):
                outs = self.compute.run(layer, [m.tensors for _, m in group], group[0][1].meta.tag)
            with self.tracer.span("send", layer=layer):
                for (i, msg), out in zip(group, outs):
                    meta = msg.meta
                    msg.release()
                    self.links.send(i, [out], (meta.step, meta.microbatch, layer, 0))

    def close(self) -> None:
        self.links.close()


def _transports(links: Links) -> dict[str, str]:
    """The M2N transport to each peer ('shm', 'tcp' or 'torch')."""
    return {name: links.transport(i) for i, name in enumerate(links.peers)}


def _idle_span(t0_ns: int):
    from afdserve.runtime.trace import Span

    t1 = time.time_ns()
    return Span("idle", t0_ns / 1e3, (t1 - t0_ns) / 1e3)


def _failed_output(rid: str, text: str | None, ids: list[int], reason: str) -> RequestOutput:
    return RequestOutput(rid, text, ids, [CompletionOutput(0, "", [], "abort")], finished=True, error=reason)


def run_worker(spec: WorkerSpec, ctl: Control) -> None:
    """Process entry point: build the worker, serve until told to stop, report failures."""
    worker = None
    try:
        worker = (AttentionWorker if spec.role == "attention" else ExpertWorker)(spec)
        worker.serve(ctl)
    except BaseException as e:  # report to the front end; it decides what fails
        try:
            ctl.send(("crash", spec.name, f"{type(e).__name__}: {e}", traceback.format_exc()))
        except Exception:
            pass
    finally:
        if worker is not None:
            worker.close()
