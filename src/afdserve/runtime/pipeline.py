"""The attention side of the ping-pong pipeline.

The batch is split into m micro-batches. In every layer, micro-batch i's MoE input is dispatched to
the expert workers, and while they compute it the attention worker computes micro-batch i+1; the
experts' partial sums come back and are combined (with the shared expert) into the layer output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afdserve.balance.load import LoadTracker
from afdserve.kvcache.cache import KVCache
from afdserve.model.attention import AttnMetadata
from afdserve.model.model import AttentionModel
from afdserve.runtime.expert_map import ExpertMap
from afdserve.runtime.links import Links
from afdserve.runtime.microbatch import MicroBatch, rows_in, split
from afdserve.runtime.trace import Tracer

GATE_ATTENTION, GATE_EXPERT = 0, 1


@dataclass
class InFlight:
    h: torch.Tensor
    y: torch.Tensor
    parts: list[tuple[int, torch.Tensor | None]]  # (expert worker, token rows it got; None = all)


class PipelinedRunner:
    def __init__(self, model: AttentionModel, kv: KVCache, links: Links, expert_map: ExpertMap,
                 micro_batches: int, gate: str, tracer: Tracer, timeout_s: float,
                 tracker: LoadTracker | None = None):
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

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttnMetadata, rows: torch.Tensor) -> torch.Tensor:
        m, tr = self.model, self.tracer
        self.step_no += 1
        if self.tracker is not None:
            self.tracker.step()
        dev = m.device
        input_ids, rows = input_ids.to(dev), rows.to(dev)
        mbs = [MicroBatch(mb.rows, mb.meta.to(dev, m.windows)) for mb in split(meta, self.m)]
        x = [m.embed_tokens(input_ids[mb.rows]) for mb in mbs]
        cos_sin = [m.rotary.cos_sin(mb.meta.positions, m.dtype) for mb in mbs]
        flight: list[InFlight | None] = [None] * len(mbs)
        for layer in range(m.cfg.num_layers):
            for i, mb in enumerate(mbs):
                if layer > 0:
                    x[i] = self.combine(i, layer - 1, flight[i])
                with tr.span("attention", mb=i, layer=layer, tokens=mb.meta.num_tokens):
                    h, y, ids, w = m.pre_moe(layer, x[i], cos_sin[i], mb.meta, self.kv)
                flight[i] = self.dispatch(i, layer, h, y, ids, w)
        # Each micro-batch's LM head runs as soon as its last layer is combined, while the experts
        # still work on the next micro-batch's last layer.
        local_rows = rows_in(mbs, rows)
        logits = []
        for i in range(len(mbs)):
            x[i] = self.combine(i, m.cfg.num_layers - 1, flight[i])
            with tr.span("attention", mb=i, layer=m.cfg.num_layers, phase="lm_head"):
                logits.append(m.logits(x[i][local_rows[i]]))
        return torch.cat(logits)

    def dispatch(self, mb: int, layer: int, h: torch.Tensor, y: torch.Tensor, ids: torch.Tensor | None,
                  w: torch.Tensor | None) -> InFlight:
        parts: list[tuple[int, torch.Tensor | None]] = []
        if not self.model.cfg.is_moe(layer):  # a dense layer: its MLP runs in combine, nothing is sent
            return InFlight(h, y, parts)
        n_exp = self.model.cfg.num_experts
        with self.tracer.span("send", mb=mb, layer=layer):
            if self.gate == GATE_EXPERT:  # every expert worker gets every token and routes itself
                for j in range(self.map.num_workers):
                    self.links.send(j, [y], (self.step_no, mb, layer, self.version))
                    parts.append((j, None))
                self.tokens_per_worker += y.shape[0]
                return InFlight(h, y, parts)
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
            else:
                owner = self.map.route(layer, ids)
            for j in range(self.map.num_workers):
                mine = owner == j
                rows = mine.any(dim=1).nonzero().squeeze(1)
                if rows.numel() == 0:
                    continue  # nothing for this worker: no message, no wait
                sub_ids = torch.where(mine[rows], ids[rows], n_exp).to(torch.int32)
                tokens = rows.to(y.device)
                self.links.send(j, [y[tokens], sub_ids, w[rows]], (self.step_no, mb, layer, self.version))
                self.tokens_per_worker[j] += tokens.numel()
                parts.append((j, tokens))
        return InFlight(h, y, parts)

    def combine(self, mb: int, layer: int, f: InFlight) -> torch.Tensor:
        if not self.model.cfg.is_moe(layer):
            with self.tracer.span("attention", mb=mb, layer=layer, phase="dense_mlp"):
                return self.model.post_moe(layer, f.h, f.y, None)
        routed = torch.zeros_like(f.y)
        # a dead peer is detected at once; a stalled one after the deadline, which grows with the
        # work in flight (a large prefill keeps an expert busy for a while)
        timeout = self.timeout * max(1.0, f.y.shape[0] / 256)
        for j, tokens in f.parts:
            with self.tracer.span("wait", mb=mb, layer=layer, peer=j):
                msg = self.links.recv(j, timeout)
            if (msg.meta.step, msg.meta.microbatch, msg.meta.layer) != (self.step_no, mb, layer):
                msg.release()
                raise RuntimeError(f"expert worker {j} answered step {msg.meta.step} micro-batch "
                                   f"{msg.meta.microbatch} layer {msg.meta.layer}, expected ({self.step_no}, {mb}, "
                                   f"{layer})")
            try:
                part = msg.tensors[0].to(routed.device)
                if tokens is None:
                    routed += part
                else:
                    routed.index_add_(0, tokens, part)
            finally:
                msg.release()
        with self.tracer.span("attention", mb=mb, layer=layer, phase="combine"):
            return self.model.post_moe(layer, f.h, f.y, routed)


def renormalized_weights(w: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Top-k weights [T, k] with the pairs not in ``keep`` zeroed and the kept ones scaled to the
    sum of all k (a token with none kept gets nothing routed)."""
    kept = torch.where(keep, w, torch.zeros_like(w))
    return kept * (w.sum(1, keepdim=True) / kept.sum(1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny))
