"""The attention side of the ping-pong pipeline: one step of a micro-batch (a *lane*, see
``runtime/lanes.py``) through every layer, its MoE inputs sent to the expert workers and their
replies combined.

``run`` is a generator that yields each ``Dispatch`` it then waits on, so that other lanes run
their attention while the experts compute; ``poll`` takes the workers' replies as they come (in
order per worker) and returns the dispatches they complete. ``forward`` runs one step on its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from afdserve.balance.load import LoadTracker
from afdserve.comm import PeerTimeoutError
from afdserve.kernels.packing import BLOCK
from afdserve.kvcache.cache import KVCache
from afdserve.model.attention import AttnMetadata
from afdserve.model.greedy import Best
from afdserve.model.model import AttentionModel
from afdserve.runtime.expert_map import ExpertMap
from afdserve.runtime.core_board import Lender, lent, slot
from afdserve.runtime.links import Links
from afdserve.runtime.lm_head import BLOCK as VOCAB_BLOCK, ClaimWords, Coverage, FixedRange, LMHeadShare, LMJob, \
    unshared_busy
from afdserve.runtime.trace import Tracer

GATE_ATTENTION, GATE_EXPERT = 0, 1
# the LM head is computed in pieces of about this long (sized by its measured rate), between which
# other lanes run: a lane whose expert replies came waits at most a piece to feed the experts again
LM_HEAD_PIECE_S = 250e-6
LM_HEAD_FIRST_PIECE = 1024  # vocabulary rows of a piece before any was measured


@dataclass
class Part:
    """An expert worker's share of a dispatch: its reply, once it came."""

    worker: int
    rows: torch.Tensor | None  # token rows it got (None: all)
    reply: Any = None  # the Message (its tensors are views of the registered slot)
    sink: Callable[[Any], None] | None = None  # LM head runs: each taken at once, released (reply stays None)


@dataclass
class Dispatch:
    """One layer of one lane's step, sent to the expert workers."""

    lane: int
    step: int
    layer: int
    h: torch.Tensor
    y: torch.Tensor
    parts: list[Part] = field(default_factory=list)
    deadline: float = 0.0
    sent: float = field(default_factory=time.perf_counter)
    lm: Coverage | None = None  # an LM head: complete once every vocabulary row is in

    @property
    def complete(self) -> bool:
        if self.lm is not None:
            return self.lm.done
        return all(p.reply is not None for p in self.parts)


class PipelinedRunner:
    def __init__(self, model: AttentionModel, kv: KVCache, links: Links, expert_map: ExpertMap,
                 micro_batches: int, gate: str, tracer: Tracer, timeout_s: float,
                 tracker: LoadTracker | None = None, lm_head_share: float = 0.0, lm_reply_bytes: int = 0,
                 lender: Lender | None = None, index: int = 0, lm_head_pieces: bool = True):
        self.model, self.kv, self.links, self.map = model, kv, links, expert_map
        self.version = 0  # of the expert map; sent with every dispatch
        self.tracker = tracker
        self.m, self.gate = micro_batches, GATE_EXPERT if gate == "expert" else GATE_ATTENTION
        self.tracer, self.timeout = tracer, timeout_s
        self.vocab_size = model.cfg.vocab_size
        self.step_no = 0
        self.tokens_per_worker = torch.zeros(expert_map.num_workers, dtype=torch.int64)
        self.full_map = expert_map  # the map without missing workers
        self.lost: torch.Tensor | None = None  # bool [L, E]: experts no live worker holds (dropped)
        self.dropped = 0  # (token, k) assignments dropped since the last report
        # per expert worker: the replies due, by (step, lane, layer); a worker may answer the
        # dispatches of different lanes out of order (it merges the same layer's tokens)
        self._expect: dict[int, dict[tuple[int, int, int], tuple[Dispatch, Part]]] = {}
        self.lm = LMHeadShare(lm_head_share, lm_reply_bytes)
        self.lm_pieces = lm_head_pieces  # else the LM head is one call (EngineConfig.lm_head_pieces)
        self.lender = lender  # this worker's cores, lent to expert workers while it waits for them
        self.index = index  # this attention worker's
        # with a core board, the LM head's blocks are taken from a shared word (work stealing); else
        # the expert workers get fixed shares
        self.claims = ClaimWords.of(lender) if lm_head_share > 0 else None
        self._lm_tag = 0
        self._lm_rate = 0.0  # LM head (vocabulary rows x token rows) per second here, measured
        self._layer_rtt = 0.0  # seconds from a layer's dispatch to its last reply, measured

    def set_map(self, version: int, expert_map: ExpertMap, missing: tuple[int, ...] = ()) -> None:
        """Switches the expert map (between steps: nothing is in flight then). With ``missing``
        expert workers (lost, their replacements not connected yet), their experts' tokens go to
        replicas; those of experts with no replica are dropped: top-(K-1) routing over the rest, the
        remaining weights scaled to the sum of all K."""
        self.version, self.full_map = version, expert_map
        self.map = expert_map.without(set(missing)) if missing else expert_map
        lost = self.map.lost_experts() if missing else None
        self.lost = lost if lost is not None and bool(lost.any()) else None
        if expert_map.num_workers != self.tokens_per_worker.numel():  # the expert pool was resized
            self.tokens_per_worker = torch.zeros(expert_map.num_workers, dtype=torch.int64)

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
                t0, w0 = time.perf_counter_ns(), time.time_ns() if self.tracer.enabled else 0
                try:
                    with lent(self.lender):  # only waiting: its cores are lent
                        got = self.links.recv_any(peers, wait)
                except PeerTimeoutError:
                    pass
                self.lm.waited(time.perf_counter_ns() - t0)
                if w0:
                    self.tracer.since("wait", w0)
            if got is None:
                d, part = min((x for q in self._expect.values() for x in q.values()), key=lambda x: x[0].deadline)
                if done or wait <= 0 or time.monotonic() < d.deadline:
                    return done
                raise PeerTimeoutError(self.links.peers[part.worker],
                                       f"no reply for step {d.step} micro-batch {d.lane} layer {d.layer} before the "
                                       f"deadline")
            j, msg = got
            self._busy_reported(j, msg)
            key = (msg.meta.step, msg.meta.microbatch, msg.meta.layer)
            hit = self._expect[j].get(key)
            if hit is None:
                msg.release()
                raise RuntimeError(f"expert worker {j} answered step {key[0]} micro-batch {key[1]} layer {key[2]}, "
                                   f"which is not in flight")
            d, part = hit
            if part.sink is None:
                del self._expect[j][key]
                part.reply = msg
            else:  # an LM head run, copied out now: a lane that takes it late holds no slot meanwhile
                try:
                    part.sink(msg)
                finally:
                    msg.release()
                if not d.complete:
                    wait = 0.0
                    continue
                self._forget(d)
            if d.complete:
                done.append(d)
                if d.layer < self.model.cfg.num_layers:
                    rtt = time.perf_counter() - d.sent
                    self._layer_rtt = rtt if self._layer_rtt <= 0 else 0.8 * self._layer_rtt + 0.2 * rtt
            wait = 0.0  # then whatever else has arrived, without waiting

    def _busy_reported(self, worker: int, msg: Any) -> None:
        """An expert worker's reply carries its busy time so far (the LM head shares balance by it)."""
        if msg.meta.ints:
            self.lm.expert_busy(worker, msg.meta.ints[0])

    def reset(self, held: list[Dispatch] = ()) -> None:
        """Forgets every dispatch in flight (a peer was lost) and gives back the replies held (also
        those of ``held``: dispatches lanes were waiting on)."""
        for d in [d for q in self._expect.values() for d, _ in q.values()] + list(held):
            for p in d.parts:
                if p.reply is not None:
                    p.reply.release()
        self._expect.clear()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttnMetadata, rows: torch.Tensor,
                greedy: bool = False) -> torch.Tensor:
        """One step on its own, waited for: logits [len(rows), vocab] (``greedy``: each row's argmax)."""
        run = self.run(0, self.next_step(), input_ids, meta, rows, greedy)
        try:
            d = next(run)
            while True:
                if d is not None:
                    self.wait(d)
                d = run.send(None)
        except StopIteration as stop:
            return stop.value

    def wait(self, d: Dispatch) -> None:
        """Takes replies until ``d`` is complete (PeerTimeoutError past its deadline)."""
        while not d.complete:
            self.poll(self.timeout)

    # ---- one lane's step --------------------------------------------------------------------------
    def run(self, lane: int, step: int, input_ids: torch.Tensor, meta: AttnMetadata,
            rows: torch.Tensor, greedy: bool = False) -> Generator[Dispatch | None, None, torch.Tensor]:
        """One step of ``lane`` through every layer: yields each ``Dispatch`` it then waits on (resume
        it once the dispatch is complete), and None where it could go on but lets other lanes run
        first (between pieces of the LM head); returns the logits [len(rows), vocab], or with
        ``greedy`` each row's argmax of them (int64 [len(rows)]; no logits are computed)."""
        m, tr = self.model, self.tracer
        input_ids, meta, rows = m.step_inputs(input_ids, meta, rows)
        x = m.embed_tokens(input_ids)
        cos_sin = m.rotary.cos_sin(meta.positions, m.dtype)
        for layer in range(m.cfg.num_layers):
            with tr.span("attention", mb=lane, layer=layer, tokens=meta.num_tokens):
                h, y, ids, w = m.pre_moe(layer, x, cos_sin, meta, self.kv)
            d = self.dispatch(lane, step, layer, h, y, ids, w)
            if d.parts:
                yield d
            x = self.combine(d)
        if not self.lm_pieces:
            with tr.span("attention", mb=lane, layer=m.cfg.num_layers, phase="lm_head"):
                return m.greedy(x[rows]) if greedy else m.logits(x[rows])
        # the LM head, in pieces between which other lanes run; the expert workers take pieces too
        xn = m.final_norm(x[rows])
        best = Best(xn.shape[0], m.device) if greedy else None
        logits = None if greedy else torch.empty(xn.shape[0], m.cfg.vocab_size, dtype=torch.float32, device=m.device)
        d, take = self._lm_job(lane, step, xn, logits, best)
        while not d.lm.done:
            got = take(self._lm_piece(xn.shape[0]) // VOCAB_BLOCK)
            if got is None:
                break
            start, end = got[0] * VOCAB_BLOCK, min(got[1] * VOCAB_BLOCK, m.cfg.vocab_size)
            t0 = time.perf_counter()
            with tr.span("attention", mb=lane, layer=m.cfg.num_layers, phase="lm_head"):
                if best is not None:
                    m.greedy_slice(xn, start, end, best)
                else:
                    m.logits_slice(xn, start, end, logits)
            self._lm_measured(xn.shape[0] * (end - start), time.perf_counter() - t0)
            d.lm.add(start, end)
            yield None
        if not d.complete:
            yield d  # the expert workers' runs are copied into the logits (merged into best) as they come
        self._forget(d)
        self.lm.step_done()
        return best.idx if best is not None else logits

    def _lm_job(self, lane: int, step: int, xn: torch.Tensor, logits: torch.Tensor | None,
                best: Best | None) -> tuple[Dispatch, Callable[[int], tuple[int, int] | None]]:
        """Starts the LM head of ``lane``'s step (into ``logits``, or a greedy one into ``best``):
        sends the job to the expert workers that help with it; returns its dispatch (complete once
        every vocabulary row is in) and how this worker takes its blocks (from the bottom)."""
        rows, vocab, last = xn.shape[0], self.vocab_size, self.model.cfg.num_layers
        blocks = -(-vocab // VOCAB_BLOCK)
        d = Dispatch(lane, step, last, xn, xn, deadline=self._deadline(rows), lm=Coverage(vocab))
        self._lm_tag = (self._lm_tag + 1) & 0xFFFF
        piece = max(1, self._lm_piece(rows) // VOCAB_BLOCK)
        workers = self._present()
        index = ClaimWords.index(self.index, lane)
        greedy = best is not None  # replies of two numbers a row: any number of rows fits
        if self.claims is not None and index >= 0 and workers and (
                greedy or rows <= self.lm.reply_bytes // (4 * VOCAB_BLOCK)):
            shared = self.claims.open(self.index, lane, self._lm_tag, blocks)  # every expert worker may help
            helpers = [(j, LMJob(self._lm_tag, piece, 0, blocks, True, greedy)) for j in workers]
            take = lambda n: shared.take(False, n)  # noqa: E731
        else:  # fixed shares, where they pay (see LMHeadShare and unshared_busy)
            shares = self.lm.shares(rows, vocab, workers, self._busy_for_lm_head(rows))
            helpers = [(j, LMJob(self._lm_tag, piece, a // VOCAB_BLOCK, -(-b // VOCAB_BLOCK), False, greedy))
                       for j, a, b in shares]
            own = FixedRange(0, shares[0][1] // VOCAB_BLOCK if shares else blocks)
            take = lambda n: own.take(False, n)  # noqa: E731

        def sink(msg: Any) -> None:
            a, b = msg.meta.ints[1], msg.meta.ints[2]
            if best is not None:
                best.merge(msg.tensors[0], msg.tensors[1])
            else:
                logits[:, a:b].copy_(msg.tensors[0])
            d.lm.add(a, b)

        with self.tracer.span("send", mb=lane, layer=last):
            for j, job in helpers:
                self._send(d, j, None, [xn], (step, lane, last, self.version), job.ints(), count=False, sink=sink)
        return d, take

    def _forget(self, d: Dispatch) -> None:
        """Stops expecting replies to ``d`` (an LM head whose rows are all in)."""
        for p in d.parts:
            self._expect.get(p.worker, {}).pop((d.step, d.lane, d.layer), None)

    def _busy_for_lm_head(self, rows: int) -> set[int]:
        busy = {j for j, q in self._expect.items() if q}  # computing another lane's layer
        return unshared_busy(busy, rows * self.vocab_size, self._lm_rate, self._layer_rtt)

    def _lm_piece(self, tokens: int) -> int:
        """Vocabulary rows of the next LM head piece for ``tokens`` token rows: about
        ``LM_HEAD_PIECE_S`` at the measured rate, whole blocks of the packed weight."""
        if self._lm_rate <= 0:
            return LM_HEAD_FIRST_PIECE
        return max(256, int(self._lm_rate * LM_HEAD_PIECE_S / max(1, tokens)) // BLOCK * BLOCK)

    def _lm_measured(self, work: int, seconds: float) -> None:
        if seconds > 0:
            rate = work / seconds
            self._lm_rate = rate if self._lm_rate <= 0 else 0.8 * self._lm_rate + 0.2 * rate

    def _deadline(self, rows: int) -> float:
        """When replies to a dispatch of ``rows`` rows are late: a dead peer is detected at once, a
        stalled one after the timeout, which grows with the work in flight (a large prefill keeps an
        expert busy for a while)."""
        return time.monotonic() + self.timeout * max(1.0, rows / 256)

    def _present(self) -> list[int]:
        """The expert workers connected now."""
        links = self.links
        present = getattr(links, "present", None)
        return [j for j, name in enumerate(getattr(links, "peers", [])) if present is None or name in present]

    def dispatch(self, lane: int, step: int, layer: int, h: torch.Tensor, y: torch.Tensor,
                 ids: torch.Tensor | None, w: torch.Tensor | None) -> Dispatch:
        """Sends the layer's MoE input to the expert workers that hold its tokens' experts."""
        d = Dispatch(lane, step, layer, h, y, deadline=self._deadline(y.shape[0]))
        if not self.model.cfg.is_moe(layer):  # a dense layer: its MLP runs in combine, nothing is sent
            return d
        n_exp, meta = self.model.cfg.num_experts, (step, lane, layer, self.version)
        with self.tracer.span("send", mb=lane, layer=layer):
            if self.gate == GATE_EXPERT:  # every expert worker gets every token and routes itself
                for j in range(self.map.num_workers):
                    self._send(d, j, None, [y], meta)
                return d
            ids, w = ids.cpu(), w.cpu()  # routing and the messages' sizes are decided on the host
            if self.tracker is not None:
                self.tracker.record(layer, ids)
            lost = self.lost[layer][ids] if self.lost is not None else None
            if lost is not None and bool(lost.any()):  # an expert worker is missing: drop its experts
                w = renormalized_weights(w, ~lost)
                self.dropped += int(lost.sum())
                held = (~self.lost[layer]).nonzero()
                if held.numel() == 0:  # no expert of this layer is held anywhere: nothing routed
                    owner = torch.full_like(ids, -1, dtype=torch.int64)
                else:  # route the lost pairs as any held expert, then take them out
                    owner = torch.where(lost, -1, self.map.route(layer, torch.where(lost, int(held[0, 0]), ids)))
            elif self.map.num_workers == 1:  # one expert worker holds every expert: all tokens, no gather
                self._send(d, 0, None, [y, ids.to(torch.int32), w], meta)
                return d
            else:
                owner = self.map.route(layer, ids)
            for j in range(self.map.num_workers):
                mine = owner == j
                rows = mine.any(dim=1).nonzero().squeeze(1)
                if rows.numel() == 0:
                    continue  # nothing for this worker: no message, no wait
                sub_ids = torch.where(mine[rows], ids[rows], n_exp).to(torch.int32)
                self._send(d, j, rows.to(y.device), [y[rows.to(y.device)], sub_ids, w[rows]], meta)
        return d

    def _send(self, d: Dispatch, worker: int, rows: torch.Tensor | None, tensors: list[torch.Tensor],
              meta: tuple[int, int, int, int], ints: tuple[int, ...] = (), count: bool = True,
              sink: Callable[[Any], None] | None = None) -> None:
        if self.lender is not None:
            self.lender.wake(slot("expert", worker))
        self.links.send(worker, tensors, meta, ints)
        if count:
            self.tokens_per_worker[worker] += d.y.shape[0] if rows is None else rows.numel()
        part = Part(worker, rows, sink=sink)
        d.parts.append(part)
        self._expect.setdefault(worker, {})[(d.step, d.lane, d.layer)] = (d, part)

    def combine(self, d: Dispatch) -> torch.Tensor:
        """The layer's output from its dispatch's replies (read in place from the registered slots)."""
        layer = d.layer
        if not self.model.cfg.is_moe(layer):
            with self.tracer.span("attention", mb=d.lane, layer=layer, phase="dense_mlp"):
                return self.model.post_moe(layer, d.h, d.y, None)
        try:
            with self.tracer.span("attention", mb=d.lane, layer=layer, phase="combine"):
                dev = d.y.device
                if len(d.parts) == 1 and d.parts[0].rows is None:
                    routed = d.parts[0].reply.tensors[0].to(dev)
                else:
                    routed = torch.zeros_like(d.y)
                    for p in d.parts:
                        part = p.reply.tensors[0].to(dev)
                        if p.rows is None:
                            routed += part
                        else:
                            routed.index_add_(0, p.rows, part)
                return self.model.post_moe(layer, d.h, d.y, routed)
        finally:
            for p in d.parts:
                p.reply.release()


def renormalized_weights(w: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Top-k weights [T, k] with the pairs not in ``keep`` zeroed and the kept ones scaled to the
    sum of all k (a token with none kept gets nothing routed)."""
    kept = torch.where(keep, w, torch.zeros_like(w))
    return kept * (w.sum(1, keepdim=True) / kept.sum(1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny))
