"""A worker's M2N links to its peers of the other role, over ``afdserve.comm``.

Peers are addressed by index (expert worker j, attention worker i); payload tensors travel in
registered slots and arrive as views that the caller releases.
"""

from __future__ import annotations

import os

from typing import Callable, Sequence

from afdserve.comm import CommConfig, Communicator, Message, PeerError, PeerTimeoutError
from afdserve.config import cpu_cores
from afdserve.runtime.control import ControlChannel
from afdserve.runtime.data_plane import ExpertInput, ExpertOutput
from afdserve.runtime.messages import Ready, Regroup, WorkerSpec


PeerFailure = PeerError  # a peer died, closed or stalled past the deadline; the message names it

# a wait spins up to this long before it sleeps where each worker thread of a local deployment has
# a core of its own: the spin then keeps no awaited peer off its core, and waking from a sleep costs
# each hand-off tens of microseconds, as long as a small batch's layer takes (where workers share
# cores, CommConfig's short spin stays: a long one would hold the peer off the core it waits on)
OWN_CORES_SPIN_S = 1e-3


def spin_options(spec: WorkerSpec) -> dict:
    """CommConfig overrides for how this worker's waits spin (see ``OWN_CORES_SPIN_S``). Every worker
    is counted with this one's threads (a deployment spec's other role may have other counts)."""
    c = spec.config
    threads = (c.attention_workers + c.expert_workers) * (c.num_threads or 1)
    return {"spin_s": OWN_CORES_SPIN_S} if c.cluster == "local" and threads <= cpu_cores() else {}


def slot_bytes(spec: WorkerSpec) -> int:
    """Largest payload of one message a worker receives: every token of a step's micro-batch with
    its hidden state (float32 at most) plus top-k ids and weights, with 64-byte alignment slack per
    tensor."""
    from afdserve.model.config import ModelConfig

    cfg = ModelConfig.from_pretrained(spec.model_path)
    return spec.config.max_num_batched_tokens * (cfg.hidden_size * 4 + cfg.top_k * 8) + 4 * 64


def max_micro_batches(started_with: int) -> int:
    """Micro-batches the links of a deployment started with ``started_with`` can carry (one slot
    per micro-batch in flight per pair -- two with a dispatch's second pass -- plus one)."""
    return max(3, started_with)


class Links:
    def __init__(self, comm: Communicator, peers: Sequence[str], present: Sequence[str] | None = None):
        self.comm, self.peers = comm, list(peers)
        self.present = list(peers if present is None else present)  # peers connected (not missing)

    @classmethod
    def connect(cls, spec: WorkerSpec, peers: Sequence[str], group: str | None = None,
                missing: Sequence[int] = (), no_spin: Callable[[], bool] | None = None) -> "Links":
        """Links to ``peers`` (but the ``missing`` indices) in the deployment's M2N group (``group``:
        of a later membership epoch); their waits do not spin while ``no_spin()`` (the worker's
        backend hooks: ``afdserve.backends.host``)."""
        store = worker_store(spec)
        c = spec.config
        rounds = 2 if c.expert_capacity_factor is not None and c.on_expert_overflow == "second-pass" else 1
        cfg = CommConfig(slot_bytes=slot_bytes(spec), num_slots=rounds * max_micro_batches(c.micro_batches) + 1,
                         transport=spec.config.comm_transport, deadline_s=spec.config.comm_timeout_ms / 1000,
                         connect_timeout_s=spec.config.startup_timeout_s, **(spin_options(spec) | spec.comm))
        comm = Communicator(spec.name, store, cfg, group=group or spec.group)
        comm.no_spin_when(no_spin)
        present = [p for i, p in enumerate(peers) if i not in set(missing)]
        comm.connect(send_to=present, recv_from=present)
        return cls(comm, peers, present)

    def send(self, peer: int, msg: ExpertInput | ExpertOutput) -> None:
        """Copies a data-plane message into ``peer``'s next registered slot."""
        self.comm.send(self.peers[peer], msg.tensors(), msg.meta())

    def recv(self, peer: int, timeout: float) -> Message:
        return self.comm.recv(self.peers[peer], timeout=timeout)

    def try_recv(self, peers: Sequence[int]) -> tuple[int, Message] | None:
        """A message one of ``peers`` has delivered, without waiting: (its index, the message), or None."""
        msg = self.comm.try_recv([self.peers[j] for j in peers])
        return None if msg is None else (self.peers.index(msg.peer), msg)

    def recv_any(self, peers: Sequence[int], timeout: float) -> tuple[int, Message]:
        """The next message of whichever of ``peers`` delivers first: (its index, the message);
        PeerTimeoutError when none came within ``timeout``."""
        if len(peers) == 1:
            return peers[0], self.comm.recv(self.peers[peers[0]], timeout=timeout)
        msg = self.comm.recv_any([self.peers[j] for j in peers], timeout=timeout)
        return self.peers.index(msg.peer), msg

    def pending(self) -> bool:
        """Some peer has a message delivered (or has failed: the next receive says so)."""
        return self.comm.pending(self.present)

    def gather(self, timeout: float, limit: int = 1) -> list[tuple[int, Message]]:
        """The messages every peer has already delivered, up to ``limit`` per peer, in each peer's
        order; if none has, waits up to ``timeout`` for a first one (empty list when nothing came)."""
        got = self._delivered(limit)
        if got or timeout <= 0:
            return got
        try:
            first = self.comm.recv_any(self.present, timeout=timeout)
        except PeerTimeoutError:
            return []
        return [(self.peers.index(first.peer), first)] + self._delivered(limit, first.peer)

    def _delivered(self, limit: int, taken: str | None = None) -> list[tuple[int, Message]]:
        got = []
        for i, name in enumerate(self.peers):
            if name not in self.present:
                continue
            for _ in range(limit - (name == taken)):
                msg = self.comm.try_recv([name])
                if msg is None:
                    break
                got.append((i, msg))
        return got

    def transport(self, peer: int) -> str:
        return self.comm.transport(self.peers[peer])

    def transports(self) -> dict[str, str]:
        """The M2N transport to each peer ('shm', 'tcp' or 'torch')."""
        return {name: self.comm.transport(name) for name in self.present}

    def close(self) -> None:
        self.comm.close()


def worker_store(spec: WorkerSpec):
    """A client of the deployment's rendezvous store (``spec.store``), which every set of a worker's
    M2N links connects through."""
    from torch.distributed import TCPStore

    return TCPStore(spec.store[0], spec.store[1], is_master=False, timeout=_td(spec.config.startup_timeout_s))


def _td(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


def regroup(links: Links | None, spec: WorkerSpec, peers: Sequence[str], msg: Regroup, ctl: ControlChannel,
            missing: Sequence[int] = (), no_spin: Callable[[], bool] | None = None) -> Links:
    """A worker's part of a membership change: close the old links (none: a deferred replacement),
    connect in the new epoch's group, say so (``Ready(worker, pid, epoch)``)."""
    if links is not None:
        links.close()
    new = Links.connect(spec, peers, group=msg.group, missing=missing, no_spin=no_spin)
    ctl.send(Ready(spec.name, os.getpid(), msg.epoch))
    return new
