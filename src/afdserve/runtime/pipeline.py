"""The attention side of the ping-pong pipeline: one step of a micro-batch (a *lane*, see
``runtime/lanes.py``) through every layer, its MoE inputs sent to the expert workers and their
replies combined.

``run`` is a generator that yields each ``Dispatch`` it then waits on, so that other lanes run
their attention while the experts compute; ``poll`` takes the workers' replies as they come (in
order per worker) and returns the dispatches they complete. ``forward`` runs one step on its own.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, field

import torch

from afdserve.backends.host import NoHooks, WorkerHooks
from afdserve.backends.step import StepBuffers
from afdserve.balance.load import LoadTracker
from afdserve.comm import PeerTimeoutError
from afdserve.engine.runner import ModelInput, ModelOutput, head, stage
from afdserve.engine.scheduler import Batch
from afdserve.kvcache.cache import KVCache
from afdserve.model.model import AttentionModel
from afdserve.runtime.data_plane import ExpertInput, ExpertOutput, LayerKey, read
from afdserve.runtime.cp import CPLinks
from afdserve.runtime.dispatch import Capacity, Dispatcher
from afdserve.runtime.expert_map import ExpertMap
from afdserve.runtime.links import Links
from afdserve.runtime.trace import Tracer

GATE_ATTENTION, GATE_EXPERT = 0, 1


@dataclass
class Part:
    """An expert worker's share of a dispatch: its reply, once it came."""

    worker: int
    rows: torch.Tensor | None  # token rows it got (None: all)
    reply: ExpertOutput | None = None  # its partial sums are views of the registered slot


@dataclass
class Dispatch:
    """One layer of one lane's step, sent to the expert workers."""

    key: LayerKey
    h: torch.Tensor
    y: torch.Tensor
    parts: list[Part] = field(default_factory=list)
    deadline: float = 0.0

    @property
    def lane(self) -> int:
        return self.key.lane

    @property
    def complete(self) -> bool:
        return all(p.reply is not None for p in self.parts)


class PipelinedRunner:
    def __init__(self, model: AttentionModel, kv: KVCache, links: Links, expert_map: ExpertMap,
                 micro_batches: int, gate: str, tracer: Tracer, timeout_s: float,
                 tracker: LoadTracker | None = None, hooks: WorkerHooks | None = None,
                 capacity: Capacity | None = None):
        self.model, self.kv, self.links, self.map = model, kv, links, expert_map
        self.version = 0  # of the expert map; sent with every dispatch
        self.tracker = tracker
        self.m, self.gate = micro_batches, GATE_EXPERT if gate == "expert" else GATE_ATTENTION
        self.tracer, self.timeout = tracer, timeout_s
        self.hooks = hooks or NoHooks()  # the backend's, around waits and sends (afdserve.backends.host)
        self.vocab_size = model.cfg.vocab_size
        self.step_no = 0
        self.full_map = expert_map  # the map without missing workers
        # the plan of each layer's dispatch, on the model's device; counts what it sent and dropped
        self.dispatcher = Dispatcher(expert_map, model.cfg.num_experts, model.cfg.top_k, capacity or Capacity(),
                                     model.device)
        self._counted = [0, 0, 0]  # the dispatcher's counters at the last ``counts``
        # per expert worker: the replies due, by layer key; a worker may answer the dispatches of
        # different lanes out of order (it merges the same layer's tokens)
        self._expect: dict[int, dict[LayerKey, tuple[Dispatch, Part]]] = {}
        self._buffers: dict[int, StepBuffers] = {}  # per lane: its step's staged inputs
        self.cp: CPLinks | None = None  # the links of context-parallel prefills (``runtime/cp.py``)

    def set_map(self, version: int, expert_map: ExpertMap, missing: tuple[int, ...] = ()) -> None:
        """Switches the expert map (between steps: nothing is in flight then). With ``missing``
        expert workers (lost, their replacements not connected yet), their experts' tokens go to
        replicas; those of experts with no replica are dropped: top-(K-1) routing over the rest, the
        remaining weights scaled to the sum of all K."""
        self.version, self.full_map = version, expert_map
        self.map = expert_map.without(set(missing)) if missing else expert_map
        lost = self.map.lost_experts() if missing else None
        self.dispatcher.set_map(self.map, lost if lost is not None and bool(lost.any()) else None)

    def counts(self) -> tuple[list[int], list[int]]:
        """Rows sent to each expert worker so far; and the (token, k) pairs dropped for a missing
        worker, those dropped over capacity and the rows sent in second passes, since the last call
        (read from the device: call it after a step, not inside one)."""
        per, now = self.dispatcher.read()
        last, self._counted = self._counted, now
        return per, [a - b for a, b in zip(now, last)]

    # ---- replies --------------------------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        """Some dispatch still waits for replies."""
        return any(self._expect.values())

    def next_step(self) -> int:
        """A new step number (messages carry it: replies are matched by step, lane and layer)."""
        self.step_no += 1
        if self.tracker is not None:
            self.tracker.step()
        return self.step_no

    def poll(self, timeout: float) -> list[Dispatch]:
        """Takes the expert replies that arrived (waiting up to ``timeout`` for the first); returns
        the dispatches they complete. PeerTimeoutError once the oldest dispatch is past its deadline."""
        done: list[Dispatch] = []
        wait = timeout
        while True:
            peers = [j for j, q in self._expect.items() if q]
            if not peers:
                return done
            got = self.links.try_recv(peers)  # what has come, without waiting
            if got is None and wait > 0:
                w0 = time.time_ns() if self.tracer.enabled else 0
                try:
                    with self.hooks.waiting():
                        got = self.links.recv_any(peers, wait)
                except PeerTimeoutError:
                    pass
                if w0:
                    self.tracer.since("wait", w0)
            if got is None:
                d, part = min((x for q in self._expect.values() for x in q.values()), key=lambda x: x[0].deadline)
                if done or wait <= 0 or time.monotonic() < d.deadline:
                    return done
                k = d.key
                raise PeerTimeoutError(self.links.peers[part.worker], f"no reply for step {k.step} micro-batch "
                                       f"{k.lane} layer {k.layer} before the deadline")
            j, msg = got
            reply = read(msg)
            hit = self._expect[j].pop(reply.key, None) if isinstance(reply, ExpertOutput) else None
            if hit is None:
                reply.release()
                k = reply.key
                raise RuntimeError(f"expert worker {j} sent {type(reply).__name__} for step {k.step} micro-batch "
                                   f"{k.lane} layer {k.layer}, which is not in flight")
            d, part = hit
            part.reply = reply
            if d.complete:
                done.append(d)
            wait = 0.0  # then whatever else has arrived, without waiting

    def reset(self, held: list[Dispatch] = ()) -> None:
        """Forgets every dispatch in flight (a peer was lost) and gives back the replies held (also
        those of ``held``: dispatches lanes were waiting on)."""
        for d in [d for q in self._expect.values() for d, _ in q.values()] + list(held):
            for p in d.parts:
                if p.reply is not None:
                    p.reply.release()
        self._expect.clear()

    @torch.inference_mode()
    def forward(self, inp: ModelInput) -> ModelOutput:
        """One step on its own, waited for."""
        run = self.run(0, self.next_step(), inp)
        try:
            d = next(run)
            while True:
                self.wait(d)
                d = run.send(None)
        except StopIteration as stop:
            return stop.value

    def wait(self, d: Dispatch) -> None:
        """Takes replies until ``d`` is complete (PeerTimeoutError past its deadline)."""
        while not d.complete:
            self.poll(self.timeout)

    # ---- one lane's step --------------------------------------------------------------------------
    def run(self, lane: int, step: int, inp: ModelInput, batch: Batch | None = None
            ) -> Generator[Dispatch, None, ModelOutput]:
        """One step of ``lane`` through every layer: yields each ``Dispatch`` it then waits on (resume
        it once the dispatch is complete); returns the step's ``ModelOutput``. ``batch``: the engine's
        batch of the step (a prefill worker's runner sends its sequences' KV layer by layer)."""
        m, tr = self.model, self.tracer
        buffers = self._buffers.get(lane)
        if buffers is None:
            buffers = self._buffers[lane] = StepBuffers(m.device)
        ring = self.cp.ring(inp.cp.shard) if inp.cp is not None else None  # a CP prefill step's
        peers = self.cp.peers(inp.sharded.shard) if inp.sharded is not None else None  # a sharded decode step's
        ctx, ids, rows = stage(m, inp, buffers, ring, peers)
        x = m.embed_tokens(ids)
        for layer in range(m.cfg.num_layers):
            with tr.span("attention", mb=lane, layer=layer, tokens=ctx.num_tokens):
                h, y, ids, w = m.pre_moe(layer, x, ctx, self.kv)
            self.attended(layer, batch)
            d = self.dispatch(LayerKey(step, lane, layer), h, y, ids, w)
            if d.parts:
                yield d
            x = self.combine(d)
        if ring is not None and inp.cp.hidden:  # prompt logprobs: the owner's LM head reads every rank's rows
            if inp.cp.shard.owner:
                x = torch.cat([x, *(h.to(x.device) for h in ring.hidden())])
            else:
                ring.send_hidden(x)
        with tr.span("attention", mb=lane, layer=m.cfg.num_layers, phase="lm_head"):
            return head(m, x, rows, inp.greedy)

    def attended(self, layer: int, batch: Batch | None) -> None:
        """The step's attention of ``layer`` is done (its KV written): nothing to do here (a prefill
        worker's runner sends it to the decode workers: ``afdserve.runtime.kv_transfer``)."""

    def _deadline(self, rows: int) -> float:
        """When replies to a dispatch of ``rows`` rows are late: a dead peer is detected at once, a
        stalled one after the timeout, which grows with the work in flight (a large prefill keeps an
        expert busy for a while)."""
        return time.monotonic() + self.timeout * max(1.0, rows / 256)

    def dispatch(self, key: LayerKey, h: torch.Tensor, y: torch.Tensor, ids: torch.Tensor | None,
                 w: torch.Tensor | None) -> Dispatch:
        """Sends the layer's MoE input to the expert workers: the plan (``runtime/dispatch.py``) is
        computed on the tokens' device, nothing of the routing is read back to the host."""
        d = Dispatch(key, h, y, deadline=self._deadline(y.shape[0]))
        layer = key.layer
        if not self.model.cfg.is_moe(layer):  # a dense layer: its MLP runs in combine, nothing is sent
            return d
        with self.tracer.span("send", mb=key.lane, layer=layer):
            if self.gate == GATE_EXPERT:  # every expert worker gets every token and routes itself
                for j in range(self.map.num_workers):
                    self._send(d, d.key, j, None, y, None, None)
                self.dispatcher.sent_whole(y.shape[0])
                return d
            if self.tracker is not None:
                self.tracker.record(layer, ids)
            t = y.shape[0]
            if self.dispatcher.whole(layer, t):  # one worker holds every expert: all tokens, no gather
                self._send(d, d.key, 0, None, y, ids.to(torch.int32), w)
                self.dispatcher.sent_whole(t)
                return d
            rounds, _ = self.dispatcher.plan(layer, ids, w)
            for part, r in enumerate(rounds):
                k = LayerKey(key.step, key.lane, layer, part)
                slots = y.index_select(0, r.src.reshape(-1)).view(*r.src.shape, -1)  # [N, C, H]: every destination's rows
                for j in r.to:
                    self._send(d, k, j, r.rows[j], slots[j], r.ids[j], r.weights[j])
        return d

    def _send(self, d: Dispatch, key: LayerKey, worker: int, rows: torch.Tensor | None, y: torch.Tensor,
              ids: torch.Tensor | None, w: torch.Tensor | None) -> None:
        self.hooks.sending("expert", worker)
        self.links.send(worker, ExpertInput(key, self.version, y, ids, w))
        part = Part(worker, rows)
        d.parts.append(part)
        self._expect.setdefault(worker, {})[key] = (d, part)

    def combine(self, d: Dispatch) -> torch.Tensor:
        """The layer's output from its dispatch's replies (read in place from the registered slots)."""
        layer = d.key.layer
        if not self.model.cfg.is_moe(layer):
            with self.tracer.span("attention", mb=d.lane, layer=layer, phase="dense_mlp"):
                return self.model.post_moe(layer, d.h, d.y, None)
        try:
            with self.tracer.span("attention", mb=d.lane, layer=layer, phase="combine"):
                dev = d.y.device
                if len(d.parts) == 1 and d.parts[0].rows is None:
                    routed = d.parts[0].reply.partial.to(dev)
                else:  # fixed-capacity slots: their padding rows add into a spare last row
                    t = d.y.shape[0]
                    routed = d.y.new_zeros(t + 1, d.y.shape[1])
                    for p in d.parts:
                        part = p.reply.partial.to(dev)
                        if p.rows is None:
                            routed[:t] += part
                        else:
                            routed.index_add_(0, p.rows, part)
                    routed = routed[:t]
                return self.model.post_moe(layer, d.h, d.y, routed)
        finally:
            for p in d.parts:
                p.reply.release()

