"""Context-parallel prefill's data plane: the CP links between the attention workers and the ring of
one CP step (``afdserve.engine.cp`` lays the step out, ``afdserve.backends.pytorch.cp_half`` computes
it).

Every layer of a CP step, rank r sends its pieces' KV (``RingKV``) to rank r+1 of the group, computes
the attention of its queries over its own keys meanwhile, then takes rank r-1's KV (forwarding it
to rank r+1 first while it has hops to go), and so on around the ring: after N-1 hops every rank has
attended over every key, merged by log-sum-exp. The owner (rank 0) writes each KV it sees into its
cache. A request asking for prompt logprobs has the helpers' final hidden states sent to the owner
(``CPHidden``).

A prompt whose KV stays sharded (``CPShard.keep``) is decoded by its owner over the shard links
(group ``<group>.cpd``): every layer of its decode step sends the query to every helper
(``ShardAsk``, a ``ShardQuery``); a helper's shard server -- a thread of its own, answering while the
helper's steps run -- computes the attention over the shard it holds (the worker's ``answer``) and
sends back a ``ShardPartial``. The server's communicator is named as the worker, the owner's side
``<worker>.ask``: each is used by one thread only.

Waits are sliced: between slices the worker's ``interrupted(handle)`` reads its control channel (an
abort of the request reaches a rank waiting on a peer that dropped it) and says whether the step
is to stop (``CPAborted``); a peer that dies raises ``PeerError`` as on any link, one that stays
silent past the deadline ``PeerTimeoutError``.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator

import torch

from afdserve.comm import CommConfig, Communicator, PeerError, PeerTimeoutError
from afdserve.engine.cp import CPShard
from afdserve.model.config import ModelConfig
from afdserve.runtime.data_plane import CPHidden, RingKV, ShardPartial, ShardQuery, read_cp
from afdserve.runtime.links import worker_store
from afdserve.runtime.messages import WorkerSpec, worker_name

CP_SLOTS = 4  # messages in flight per pair: a rank runs at most a layer ahead of the next one
WAIT_SLICE_S = 0.05  # a wait looks at the control channel this often
CP_DEADLINE_FACTOR = 30  # a CP wait's deadline in comm timeouts (a peer may wait for its blocks first)
SHARD_ROWS = 8  # queries per shard message, at most

# a helper's answer to a shard query: (handle, layer, q, positions) -> (o, lse), or None (no such shard)
Answer = Callable[[int, int, torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor] | None"]


class CPAborted(Exception):
    """While a rank waited for its peers, the CP step's request was aborted (the step is dropped) or
    the membership changed (the step runs again once the links are new)."""


class CPLinks:
    """This attention worker's links to every other attention worker (group ``<group>.cp``)."""

    def __init__(self, spec: WorkerSpec, model_cfg: ModelConfig, interrupted: Callable[[int], bool],
                 group: str | None = None, attention_workers: int | None = None, answer: Answer | None = None):
        c = spec.config
        self.interrupted = interrupted
        self.names = [worker_name("attention", i) for i in range(attention_workers or c.attention_workers)]
        peers = [n for i, n in enumerate(self.names) if i != spec.index]
        # the largest message: one layer's KV of a rank's tokens (at most a step's token budget), or
        # its final hidden states, in float32 at most, with their positions
        width = max(2 * model_cfg.num_kv_heads * model_cfg.head_dim, model_cfg.kv_latent_dim, model_cfg.hidden_size)
        self.timeout = c.comm_timeout_ms / 1000 * CP_DEADLINE_FACTOR
        store = worker_store(spec)
        cfg = CommConfig(slot_bytes=c.max_num_batched_tokens * (width * 4 + 8) + 4 * 64, num_slots=CP_SLOTS,
                         transport=c.comm_transport, deadline_s=self.timeout, connect_timeout_s=c.startup_timeout_s)
        self.comm = Communicator(spec.name, store, cfg, group=f"{group or spec.group}.cp")
        self.comm.connect(send_to=peers, recv_from=peers)
        # the shard links: queries and partials of one layer of a decode step, float32 at most
        heads = model_cfg.num_heads * max(model_cfg.head_dim, model_cfg.kv_latent_dim)
        scfg = CommConfig(slot_bytes=SHARD_ROWS * (heads * 4 + model_cfg.num_heads * 4 + 8) + 4 * 64,
                          num_slots=CP_SLOTS, transport=c.comm_transport, deadline_s=self.timeout,
                          connect_timeout_s=c.startup_timeout_s)
        asks = [f"{p}.ask" for p in peers]
        self.steps = 0  # sharded decode steps asked so far (their replies are told apart by it)
        self.answer = answer
        # (a store client of its own: the server's thread connects while this one does)
        self.server = Communicator(spec.name, worker_store(spec), scfg, group=f"{group or spec.group}.cpd")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(asks,), name=f"{spec.name}-shards", daemon=True)
        self._thread.start()  # connects the server's side while this thread connects the asking side
        self.asks = Communicator(f"{spec.name}.ask", store, scfg, group=f"{group or spec.group}.cpd")
        self.asks.connect(send_to=peers, recv_from=peers)
        self.connect_timeout = c.startup_timeout_s

    def recv(self, comm: Communicator, peer: str, handle: int, what: str, deadline: float):
        """The next message from ``peer`` on ``comm`` (typed: ``read_cp``), waited for in slices:
        CPAborted once ``interrupted(handle)``, PeerTimeoutError past ``deadline`` (monotonic)."""
        while True:
            try:
                return read_cp(comm.recv(peer, timeout=WAIT_SLICE_S))
            except PeerTimeoutError:
                if self.interrupted(handle):
                    raise CPAborted(f"{what} was aborted") from None
                if time.monotonic() > deadline:
                    raise PeerTimeoutError(peer, f"no message of {what} before the deadline") from None

    def ring(self, shard: CPShard) -> "CPRing":
        return CPRing(self, shard)

    def peers(self, shard: CPShard) -> "ShardAsk":
        """The helpers of a sharded decode step of ``shard``'s sequence (this worker owns it)."""
        self.steps += 1
        return ShardAsk(self, shard, self.steps)

    def _serve(self, asks: list[str]) -> None:
        """The shard server's thread: answers every query with the worker's ``answer``."""
        try:
            self.server.connect(send_to=asks, recv_from=asks)
        except Exception as e:  # the asking side's connect fails too: the worker reports that
            print(f"{self.server.name}: shard links not connected: {e}", file=sys.stderr)
            return
        live = list(asks)
        while live and not self._stop.is_set():
            try:
                msg = self.server.recv_any(live, timeout=WAIT_SLICE_S)
            except PeerTimeoutError:
                continue
            except PeerError as e:  # gone: its queries end (the links are new after the regroup)
                live = [p for p in live if p not in e.peers]
                continue
            q = read_cp(msg)
            try:
                if not isinstance(q, ShardQuery):
                    raise ValueError(f"{msg.peer} sent {type(q).__name__} on the shard links")
                part = self.answer(q.handle, q.layer, q.q, q.positions) if self.answer is not None else None
                reply = ShardPartial(q.step, q.handle, q.layer, part)
            except Exception:  # answered as no shard: the owner drops the step (and the request ends)
                traceback.print_exc()
                reply = ShardPartial(q.step, getattr(q, "handle", -1), getattr(q, "layer", -1), None)
            finally:
                q.release()
            try:
                self.server.send(msg.peer, reply.tensors(), reply.meta())
            except PeerError:
                live.remove(msg.peer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.connect_timeout + 1)
        for comm in (self.comm, self.asks, self.server):
            comm.close()


class ShardAsk:
    """The owner's side of one sharded decode step (``afdserve.backends.base.ShardPeers``)."""

    def __init__(self, links: CPLinks, shard: CPShard, step: int):
        self.links, self.shard, self.step = links, shard, step
        self.helpers = [links.names[i] for i in shard.ranks[1:]]

    def ask(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        msg = ShardQuery(self.step, self.shard.handle, layer, q, positions)
        for h in self.helpers:
            self.links.asks.send(h, msg.tensors(), msg.meta())

    def answers(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for h in self.helpers:
            m = self._recv(h, layer)
            try:
                if m.partial is None:  # the helper holds no shard of it (the request is ending there)
                    raise CPAborted(f"{h} holds no shard of sharded prompt {self.shard.handle}")
                out.append((m.partial[0].clone(), m.partial[1].clone()))
            finally:
                m.release()
        return out

    def _recv(self, peer: str, layer: int) -> ShardPartial:
        """``peer``'s answer of this step's ``layer`` (those of steps dropped before are dropped)."""
        handle, links = self.shard.handle, self.links
        deadline = time.monotonic() + links.timeout
        while True:
            m = links.recv(links.asks, peer, handle, f"sharded prompt {handle}", deadline)
            if isinstance(m, ShardPartial) and m.step < self.step:
                m.release()
                continue
            if not isinstance(m, ShardPartial) or (m.step, m.handle, m.layer) != (self.step, handle, layer):
                m.release()
                raise RuntimeError(f"{peer} sent {type(m).__name__} while the answer of step {self.step} of sharded "
                                   f"prompt {handle} (layer {layer}) was due")
            return m


class CPRing:
    """The ring of one CP step (``afdserve.backends.base.Ring``)."""

    def __init__(self, links: CPLinks, shard: CPShard):
        self.links, self.shard = links, shard
        n, r, names = shard.size, shard.rank, links.names
        self.next, self.prev = names[shard.ranks[(r + 1) % n]], names[shard.ranks[(r - 1) % n]]
        self.owner = names[shard.ranks[0]]

    def send(self, layer: int, parts: list[torch.Tensor], positions: torch.Tensor) -> None:
        if self.shard.size > 1:
            msg = RingKV(self.shard.handle, layer, self.shard.rank, parts, positions)
            self.links.comm.send(self.next, msg.tensors(), msg.meta())

    def receive(self, layer: int) -> Iterator[tuple[int, list[torch.Tensor], torch.Tensor]]:
        n = self.shard.size
        for hop in range(n - 1):
            m = self._recv(self.prev, RingKV, layer)
            try:
                if hop < n - 2:  # on to the next rank before this one computes over it
                    self.links.comm.send(self.next, m.tensors(), m.meta())
                yield m.origin, m.parts, m.positions
            finally:
                m.release()

    def send_hidden(self, x: torch.Tensor) -> None:
        """A helper's final hidden states, to the owner."""
        msg = CPHidden(self.shard.handle, self.shard.rank, x)
        self.links.comm.send(self.owner, msg.tensors(), msg.meta())

    def hidden(self) -> list[torch.Tensor]:
        """The owner's: every helper's final hidden states, in rank order."""
        out = []
        for r in range(1, self.shard.size):
            m = self._recv(self.links.names[self.shard.ranks[r]], CPHidden, -1)
            out.append(m.hidden.clone())
            m.release()
        return out

    def _recv(self, peer: str, kind: type, layer: int) -> RingKV | CPHidden:
        """The next message of this step from ``peer`` (older CP steps' leftovers are dropped)."""
        handle, links = self.shard.handle, self.links
        deadline = time.monotonic() + links.timeout
        while True:
            m = links.recv(links.comm, peer, handle, f"CP prefill {handle}", deadline)
            if m.handle < handle:  # of a CP prefill aborted meanwhile
                m.release()
                continue
            if not isinstance(m, kind) or m.handle != handle or (kind is RingKV and m.layer != layer):
                m.release()
                raise RuntimeError(f"{peer} sent {type(m).__name__} of CP prefill {m.handle} while "
                                   f"{kind.__name__} of {handle} (layer {layer}) was due")
            return m
