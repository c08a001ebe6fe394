"""The front end's part of context-parallel prefill (``context_parallel_size`` N > 1).

A prompt of at least ``cp_min_tokens`` tokens is prefilled by N attention workers at once when its
zigzag split (``afdserve.kvcache.cp_split``) gives every rank a share that fits one step
(``max_num_batched_tokens``); other prompts are prefilled the usual way (chunked, on one worker).
The owner (rank 0) is placed as any request is (``cluster/prefix_routing.py``: load and prefix-cache
affinity) and the request is booked there alone; the other N-1 ranks are the least loaded other
attention workers. Every rank gets the request (``AddRequest`` with its ``CPShard``: the prefill's
handle -- an increasing number, the order every worker runs its CP prefills in --, the ranks and
every rank's pieces); the helpers pass their pieces' KV along the ring, the owner samples the
first token. Where the KV goes (``cp_kv``): gathered on the owner, which decodes the request as any
other, or sharded (``CPShard.keep``: every rank keeps its pieces' KV and the owner's decode steps
ask the helpers for their shards' attention) -- "auto" shards it where the request (its prompt and
``max_tokens``, up to the context) does not fit one worker's KV cache. A request that fits neither
way is refused (RequestError) rather than left waiting for blocks that never come.

The owner's first output ends the helpers' part of a gathered prompt; a sharded one's, the request's
end. Until then an abort (cancel, failure) reaches every rank, and a lost (or, on a resize, leaving)
rank ends the attempt: the request is aborted on the other ranks and submitted again as a new CP
prefill (of the prompt and the tokens delivered so far), as ``PDRouter.readmit`` starts a move over
-- a new handle, and another owner where the old one is up, so that what the old one sent before
its abort is told apart (an output of a request from a worker that does not own it is dropped);
after ``MAX_CRASHES_PER_REQUEST`` attempts so ended, the usual way on one worker where it fits one.
A request its owner was decoding (gathered) when the owner was lost is re-admitted as any other
(``ClusterClient._readmit``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from afdserve.balance.attention import AttentionBalancer
from afdserve.cluster.prefix_routing import place
from afdserve.cluster.supervisor import MAX_CRASHES_PER_REQUEST
from afdserve.engine.builder import kv_blocks
from afdserve.engine.outputs import TokenOutput
from afdserve.engine.sampling_params import SamplingParams
from afdserve.errors import RequestError
from afdserve.kvcache.cache import KVCache
from afdserve.kvcache.cp_split import zigzag
from afdserve.runtime.messages import AbortRequests, AddRequest, CPShard, batched

if TYPE_CHECKING:
    from afdserve.cluster.client import ClusterClient

Split = tuple[tuple[tuple[int, int], ...], ...]  # per rank, its pieces [start, end)


@dataclass(frozen=True)
class CPPrefill:
    """A request's CP prefill under way."""

    handle: int
    ranks: tuple[str, ...]  # attention workers, the owner first
    attempt: int = 1  # the request's CP prefills so far (one more each time a lost rank ended one)
    keep: bool = False  # its KV stays sharded: the helpers hold theirs until the request ends


@dataclass(frozen=True)
class Withdrawn:
    """A request whose CP prefill a lost or leaving rank ended, to be submitted again."""

    request_id: str
    attempt: int
    avoid: str | None  # its owner, where still up: not its owner again (its outputs of the attempt ended are stale)


def cp_split(n: int, ranks: int, block_size: int, min_tokens: int, step_tokens: int) -> Split | None:
    """The pieces of a prompt of ``n`` tokens over ``ranks`` ranks, or None where it does not go
    context parallel: fewer than 2 ranks or ``min_tokens`` tokens, a rank's share over one step's
    ``step_tokens``, or a split that leaves a rank without a share or the last token off the owner."""
    if ranks < 2 or n < min_tokens:
        return None
    pieces = zigzag(n, ranks, block_size)
    if not all(pieces) or pieces[0][-1][1] != n:
        return None
    if max(sum(end - start for start, end in p) for p in pieces) > step_tokens:
        return None
    return pieces


class CPRouter:
    def __init__(self, client: "ClusterClient"):
        self.client = client
        self.size = client.config.context_parallel_size
        self.prefilling: dict[str, CPPrefill] = {}  # request id -> its CP prefill, until the owner's first output
        self.sharded: dict[str, CPPrefill] = {}  # then those whose KV stays sharded, until they end
        self.handles = 0  # the last handle given (the CP prefills started so far)
        cfg = client.config
        self.worker_blocks = kv_blocks(cfg, client.model_cfg, client.max_model_len)  # one worker's KV cache

    def split(self, n: int) -> Split | None:
        """How a prompt of ``n`` tokens is split now (None: the usual way); N ranks, or as many as there
        are attention workers."""
        cfg = self.client.config
        return cp_split(n, min(self.size, len(self.client.attention)), cfg.block_size, cfg.cp_min_tokens,
                        cfg.max_num_batched_tokens)

    def _blocks(self, tokens: int) -> int:
        cfg = self.client.config
        return KVCache.sequence_blocks(tokens, cfg.block_size, self.client.model_cfg.kv_window,
                                       cfg.max_num_batched_tokens)

    def fits_one(self, n: int, params: SamplingParams) -> bool:
        """Whether a request of ``n`` tokens so far fits one worker's KV cache to its end."""
        return self._blocks(min(n + params.max_tokens, self.client.max_model_len)) <= self.worker_blocks

    def submit(self, rid: str, ids: list[int], params: SamplingParams, adds: dict[str, list[AddRequest]],
               attempt: int = 1, avoid: str | None = None, out: list[int] | None = None) -> bool:
        """A prompt that goes context parallel: booked on its owner (not ``avoid``), every rank's
        ``AddRequest`` appended to ``adds`` (worker -> its requests, sent in order; the helpers'
        first). ``out``: the tokens the request delivered already (submitted again): the owner
        computes them after the prompt's CP prefill. False: not context parallel (nothing done);
        RequestError where the request fits neither one worker nor the ranks' caches sharded."""
        out = out or []
        n = len(ids) + len(out)
        fits = self.fits_one(n, params)
        pieces = self.split(len(ids))  # (the tokens delivered are computed after it, on the owner)
        if pieces is None:
            if not fits:
                raise RequestError(f"request {rid}: {n} tokens and max_tokens={params.max_tokens} need more KV than "
                                   f"one attention worker holds ({self.worker_blocks} blocks of "
                                   f"{self.client.config.block_size} tokens), and it does not go context parallel")
            return False
        cfg = self.client.config
        keep = cfg.cp_kv == "shard" or (cfg.cp_kv == "auto" and not fits)
        if keep:
            owner_share = sum(b - a for a, b in pieces[0]) + min(params.max_tokens, self.client.max_model_len - len(ids))
            if max(self._blocks(owner_share), *(self._blocks(sum(b - a for a, b in p)) for p in pieces)) \
                    > self.worker_blocks:
                raise RequestError(f"request {rid}: {n} tokens and max_tokens={params.max_tokens} need more KV than "
                                   f"{len(pieces)} attention workers hold sharded ({self.worker_blocks} blocks each)")
        c = self.client
        owner = self._place(rid, ids, params, avoid)
        ranks = (owner, *self._helpers(owner, len(pieces) - 1))
        c.requests[rid] = (ids, params)
        self.handles += 1
        self.prefilling[rid] = CPPrefill(self.handles, ranks, attempt, keep)
        index = tuple(c.attention.index(w) for w in ranks)
        for r in reversed(range(len(ranks))):
            shard = CPShard(self.handles, r, index, pieces, keep)
            adds.setdefault(ranks[r], []).append(AddRequest(rid, ids, params, list(out), cp=shard))
        return True

    def _place(self, rid: str, ids: list[int], params: SamplingParams, avoid: str | None) -> str:
        """The request's owner, placed and booked as any request (but not on ``avoid``)."""
        c, bal = self.client, self.client.balancer
        if avoid is not None:  # the same booking (lengths), one worker fewer to choose from
            bal = AttentionBalancer([w for w in bal.workers if w != avoid], bal.cost, bal.lengths, bal.cache_slack)
        owner = place(bal, c.routes, rid, ids, params.max_tokens, len(bal.workers) > 1)
        c.owner[rid], c.lengths[rid] = owner, len(ids)
        return owner

    def _helpers(self, owner: str, n: int) -> list[str]:
        """The ``n`` least loaded attention workers but ``owner`` (by the balancer's predicted step
        time; then the fewest CP prefills they help with now; then in order)."""
        c = self.client
        helping = Counter(w for p in self.prefilling.values() for w in p.ranks[1:])
        others = [w for w in c.attention if w != owner]
        return sorted(others, key=lambda w: (c.balancer.predicted(w), helping[w]))[:n]

    def outputs(self, name: str, outs: list[TokenOutput]) -> list[TokenOutput]:
        """A worker's outputs: the owner's first output of a request ends its CP prefill (the
        helpers are done). The output of a request from a worker that does not own it is not the
        request's: a helper's, or what the owner of an attempt that a lost rank ended sent before
        its abort (the request has another owner since)."""
        kept, owner = [], self.client.owner
        for o in outs:
            if owner.get(o.request_id, name) != name:
                continue
            p = self.prefilling.pop(o.request_id, None)
            if p is not None and p.keep:  # its helpers hold their shards until it ends (``forget``)
                self.sharded[o.request_id] = p
            kept.append(o)
        return kept

    def forget(self, rid: str) -> None:
        """The request is over (finished, failed, cancelled): the helpers still in its CP prefill
        abort it (the client aborts it on the owner)."""
        p = self.prefilling.pop(rid, None) or self.sharded.pop(rid, None)
        if p is not None:
            self._abort(rid, p.ranks[1:])

    def _abort(self, rid: str, workers: tuple[str, ...] | list[str]) -> None:
        for w in workers:
            if w in self.client.workers:
                self.client.workers[w].send(AbortRequests([rid]))

    def readmit(self, worker: str) -> None:
        """``worker`` was replaced: the CP prefills it was a rank of start over; the requests it owned
        past their prefill are recomputed there."""
        again = self.withdraw([worker])
        self.client._readmit(worker)  # first: a request submitted again may be owned by ``worker`` now
        self.resubmit(again)

    def withdraw(self, workers: list[str]) -> list[Withdrawn]:
        """Ends the CP prefills that ``workers`` (lost or leaving) are ranks of: aborted on their other
        ranks, their booking dropped (their prompt and params kept), for ``resubmit``."""
        c, gone, out = self.client, set(workers), []
        for rid, p in [*self.prefilling.items(), *self.sharded.items()]:
            if gone.isdisjoint(p.ranks):
                continue
            (self.prefilling if rid in self.prefilling else self.sharded).pop(rid)
            self._abort(rid, [w for w in p.ranks if w not in gone])
            c.balancer.remove(c.owner.pop(rid), rid)
            out.append(Withdrawn(rid, p.attempt, None if p.ranks[0] in gone else p.ranks[0]))
        return out

    def resubmit(self, withdrawn: list[Withdrawn]) -> None:
        """Submits withdrawn requests again, each to another owner than before where that one is up:
        a new CP prefill (a new handle, new ranks), or the usual way on one worker where the prompt
        no longer goes context parallel or its CP prefills were ended ``MAX_CRASHES_PER_REQUEST``
        times."""
        c, adds = self.client, dict[str, list[AddRequest]]()
        for w in withdrawn:
            rid, avoid = w.request_id, w.avoid if w.avoid in self.client.attention else None
            ids, params = c.requests[rid]
            out = c.delivered(rid)
            try:
                if (w.attempt >= MAX_CRASHES_PER_REQUEST and self.fits_one(len(ids) + len(out), params)) \
                        or not self.submit(rid, ids, params, adds, w.attempt + 1, avoid, out):
                    adds.setdefault(self._place(rid, ids, params, avoid), []).append(AddRequest(rid, ids, params, out))
            except RequestError as e:  # it fits no longer (fewer attention workers): it ends with the reason
                c._held.append(TokenOutput(rid, [], "abort", error=str(e)))
        for target, batch in adds.items():
            for msg in batched(batch):
                c.workers[target].send(msg)
