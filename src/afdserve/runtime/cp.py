"""Context-parallel prefill's data plane: the CP links between the attention workers and the ring of
one CP step (``afdserve.engine.cp`` lays the step out, ``afdserve.backends.pytorch.cp_half`` computes
it).

Every layer of a CP step, rank r sends its pieces' KV (``RingKV``) to rank r+1 of the group, computes
the attention of its queries over its own keys meanwhile, then takes rank r-1's KV (forwarding it
to rank r+1 first while it has hops to go), and so on around the ring: after N-1 hops every rank has
attended over every key, merged by log-sum-exp. The owner (rank 0) writes each KV it sees into its
cache. A request asking for prompt logprobs has the helpers' final hidden states sent to the owner
(``CPHidden``).

Waits are sliced: between slices the worker's ``interrupted(handle)`` reads its control channel (an
abort of the request reaches a rank waiting on a peer that dropped it) and says whether the step
is to stop (``CPAborted``); a peer that dies raises ``PeerError`` as on any link, one that stays
silent past the deadline ``PeerTimeoutError``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from afdserve.comm import CommConfig, Communicator, PeerTimeoutError
from afdserve.engine.cp import CPShard
from afdserve.model.config import ModelConfig
from afdserve.runtime.data_plane import CPHidden, RingKV, read_cp
from afdserve.runtime.links import worker_store
from afdserve.runtime.messages import WorkerSpec, worker_name

CP_SLOTS = 4  # messages in flight per pair: a rank runs at most a layer ahead of the next one
WAIT_SLICE_S = 0.05  # a wait looks at the control channel this often
CP_DEADLINE_FACTOR = 30  # a CP wait's deadline in comm timeouts (a peer may wait for its blocks first)


class CPAborted(Exception):
    """While a rank waited for its peers, the CP step's request was aborted (the step is dropped) or
    the membership changed (the step runs again once the links are new)."""


class CPLinks:
    """This attention worker's links to every other attention worker (group ``<group>.cp``)."""

    def __init__(self, spec: WorkerSpec, model_cfg: ModelConfig, interrupted: Callable[[int], bool],
                 group: str | None = None, attention_workers: int | None = None):
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

    def ring(self, shard: CPShard) -> "CPRing":
        return CPRing(self, shard)

    def close(self) -> None:
        self.comm.close()


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
            try:
                msg = links.comm.recv(peer, timeout=WAIT_SLICE_S)
            except PeerTimeoutError:
                if links.interrupted(handle):
                    raise CPAborted(f"CP prefill {handle} was aborted") from None
                if time.monotonic() > deadline:
                    raise PeerTimeoutError(peer, f"no CP message of prefill {handle} before the deadline") from None
                continue
            m = read_cp(msg)
            if m.handle < handle:  # of a CP prefill aborted meanwhile
                m.release()
                continue
            if not isinstance(m, kind) or m.handle != handle or (kind is RingKV and m.layer != layer):
                m.release()
                raise RuntimeError(f"{peer} sent {type(m).__name__} of CP prefill {m.handle} while "
                                   f"{kind.__name__} of {handle} (layer {layer}) was due")
            return m
