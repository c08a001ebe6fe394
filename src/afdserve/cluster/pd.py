"""The front end's part of prefill/decode disaggregation (``prefill_workers`` + ``decode_workers``).

A new request goes to a prefill worker and, at once, a decode worker reserves its blocks
(``ReserveKV``; both chosen by load and prefix-cache affinity, as ``cluster/prefix_routing.py``
places any request). With the reservation (``KVReserved``) the prefill worker gets the request
(``AddRequest`` with its ``KVTarget``, for one token): it sends the KV layer by layer as it computes
it (``runtime/kv_transfer.py``). Its first token goes out to the caller as usual and, unless the
request ends there, the request moves: the decode worker takes it over (``AdoptKV``) once the KV
has landed.

Faults: a lost prefill worker's requests, or those a lost decode worker was receiving, start over
(the other side's reservation or request is aborted, its blocks freed); requests a lost decode
worker was decoding are recomputed by its replacement (``ClusterClient._readmit``). An aborted
request frees both sides.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from afdserve.balance.attention import AttentionBalancer
from afdserve.cluster.prefix_routing import place
from afdserve.engine.outputs import TokenOutput
from afdserve.engine.sampling_params import SamplingParams
from afdserve.runtime.messages import AbortRequests, AddRequest, AdoptKV, KVReserved, KVTarget, ReserveKV

if TYPE_CHECKING:
    from afdserve.cluster.client import ClusterClient


@dataclass
class Move:
    """A request on its way from its prefill worker to its decode worker."""

    prefill: str
    decode: str
    attempt: int
    handle: int | None = None  # the decode worker's reservation, once made

    def on_prefill(self, rid: str) -> str:
        """The request's id on the prefill worker: one per attempt, so that what an attempt aborted
        there still sends is told apart."""
        return f"{rid}@{self.attempt}"


class PDRouter:
    def __init__(self, client: "ClusterClient"):
        c, n = client, client.config.prefill_workers
        self.client = c
        self.prefill, self.decode = c.attention[:n], c.attention[n:]
        # the client's balancer's booking (lengths) is shared: a request is booked where it runs now
        self.pbal = AttentionBalancer(self.prefill, c.balancer.cost, c.balancer.lengths)
        self.dbal = AttentionBalancer(self.decode, c.balancer.cost, c.balancer.lengths)
        self.moving: dict[str, Move] = {}
        self.attempts = 0

    def submit(self, rid: str, ids: list[int], params: SamplingParams) -> None:
        """Books the request on a prefill worker and asks a decode worker for its blocks."""
        c = self.client
        p = place(self.pbal, c.routes, rid, ids, params.max_tokens, len(self.prefill) > 1)
        d = self.dbal.pick(len(ids), params.max_tokens, c.routes.match(c.routes.key(ids))
                           if c.routes is not None and len(self.decode) > 1 else None)
        c.owner[rid], c.lengths[rid], c.requests[rid] = p, len(ids), (ids, params)
        self.attempts += 1
        self.moving[rid] = Move(p, d, self.attempts)
        c.workers[d].send(ReserveKV(rid, ids, self.attempts))

    def reserved(self, msg: KVReserved) -> None:
        """A decode worker holds the blocks: the prefill worker gets the request."""
        mv = self.moving.get(msg.request_id)
        c = self.client
        if mv is None or mv.attempt != msg.attempt:  # cancelled or re-routed meanwhile: the abort sent
            return  # then frees it (the decode worker reads it after its reservation)
        mv.handle = msg.handle
        ids, params = c.requests[msg.request_id]
        first = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        target = KVTarget(c.attention.index(mv.decode), msg.handle, msg.skip_blocks)
        c.workers[mv.prefill].send(AddRequest(mv.on_prefill(msg.request_id), ids, first, kv=target))

    def outputs(self, name: str, outs: list[TokenOutput]) -> list[TokenOutput]:
        """A prefill worker's outputs: a first token that does not end its request hands it over."""
        if name not in self.prefill:
            return outs
        c, kept = self.client, []
        for o in outs:
            rid = o.request_id.rpartition("@")[0]
            mv = self.moving.get(rid)
            if mv is None or mv.on_prefill(rid) != o.request_id or mv.prefill != name:
                continue  # of an attempt aborted there (the request was re-routed or is over)
            kept.append(replace(o, request_id=rid))
            if not o.new_token_ids or o.finish_reason != "length":
                continue
            ids, params = c.requests[rid]
            if params.max_tokens <= 1 or len(ids) + 1 >= c.max_model_len:
                continue  # it really ends here
            kept[-1] = replace(kept[-1], finish_reason=None, stop_reason=None)
            del self.moving[rid]
            c.balancer.remove(mv.prefill, rid)
            c.owner[rid] = mv.decode
            c.balancer.add(mv.decode, rid, len(ids) + 1)
            if c.routes is not None:
                c.routes.add(mv.decode, c.routes.key(ids))
            c.workers[mv.decode].send(AdoptKV(rid, mv.handle, ids, params, list(o.new_token_ids)))
        return kept

    def forget(self, rid: str) -> None:
        """The request is over (finished, failed, cancelled): a reservation it still holds goes back."""
        mv = self.moving.pop(rid, None)
        if mv is not None:
            self._abort(mv, rid)

    def _abort(self, mv: Move, rid: str, but: str | None = None) -> None:
        """Aborts the request on both workers of its move (but ``but``): the decode worker's reservation
        (queued, filling or landed), the prefill worker's attempt."""
        workers = self.client.workers
        for name, what in ((mv.decode, rid), (mv.prefill, mv.on_prefill(rid))):
            if name != but and name in workers:
                workers[name].send(AbortRequests([what]))

    def readmit(self, worker: str) -> None:
        """``worker`` was replaced: the requests on their way from or to it start over; those it was
        decoding are recomputed there."""
        c = self.client
        for rid, mv in list(self.moving.items()):
            if worker not in (mv.prefill, mv.decode):
                continue
            del self.moving[rid]
            self._abort(mv, rid, but=worker)  # the other side's reservation, or its prefill
            c.balancer.remove(c.owner.pop(rid), rid)
            ids, params = c.requests[rid]
            self.submit(rid, ids, params)
        if worker in self.decode:
            c._readmit(worker)
