"""Prefill/decode disaggregation's data plane: a prompt's KV moves layer by layer, while the later
layers still prefill, from the prefill attention worker that computes it into the blocks a decode
attention worker reserved for it up front.

* The decode worker reserves (``ReserveKV`` -> ``KVReceiver.reserve``): its prefix cache's hits are
  held, not copied (the transfer skips those blocks), the other blocks are allocated; the reply
  (``KVReserved``) goes to the prefill worker with the request (``KVTarget``).
* The prefill worker's runner (``PrefillRunner``) sends, as each layer's attention of a step ends,
  that layer's blocks of every transferred sequence the step computed (``KVBlocks``, as stored:
  fp8 blocks with their scales, MLA's latent) over M2N links of their own (group ``<group>.kv``:
  prefill workers send, decode workers receive; registered slots of ``KV_SLOTS`` x a chunk's blocks).
* The decode worker copies each message's blocks in place into its paged cache, and decodes the
  request (``Engine.adopt``) once every layer has landed and the prefill's first token came
  (``AdoptKV``).

A message of a reservation no longer held (aborted, re-routed) is dropped; an aborted reservation's
blocks go back at once. The same links and messages carry KV between any two attention workers.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from afdserve.comm import CommConfig, Communicator, PeerError
from afdserve.engine.engine import Engine
from afdserve.engine.scheduler import Batch
from afdserve.kvcache.block_manager import PrefixHit
from afdserve.kvcache.cache import KVCache
from afdserve.kvcache.prefix import block_hashes
from afdserve.runtime.data_plane import KVBlocks, read_kv
from afdserve.runtime.links import worker_store
from afdserve.runtime.messages import AdoptKV, KVLanded, KVReserved, KVTarget, ReserveKV, WorkerSpec, worker_name
from afdserve.runtime.pipeline import PipelinedRunner

KV_SLOTS = 8  # messages in flight per (prefill, decode) pair
LANDED_KEPT = 1024  # transfer records a decode worker keeps for the next GetStats


def pd_role(spec: WorkerSpec) -> str:
    """"prefill", "decode" or "mixed" (no disaggregation): attention workers 0..P-1 prefill."""
    c = spec.config
    if not c.prefill_workers:
        return "mixed"
    return "prefill" if spec.index < c.prefill_workers else "decode"


def chunk_blocks(spec: WorkerSpec) -> int:
    """Blocks of one layer one message carries at most: a step's token budget, one block more."""
    c = spec.config
    return -(-c.max_num_batched_tokens // c.block_size) + 1


def kv_links(spec: WorkerSpec, kv: KVCache, group: str | None = None) -> Communicator:
    """This worker's end of the KV links: a prefill worker sends to every decode worker, a decode
    worker receives from every prefill worker (slots sized by its own cache's blocks)."""
    c = spec.config
    prefill = [worker_name("attention", i) for i in range(c.prefill_workers)]
    decode = [worker_name("attention", c.prefill_workers + j) for j in range(c.decode_workers)]
    per_block = sum(t[0].numel() * t.element_size() for t in kv.layer_blocks(0))
    store = worker_store(spec)
    cfg = CommConfig(slot_bytes=per_block * chunk_blocks(spec) + 8 * 64, num_slots=KV_SLOTS,
                     transport=c.comm_transport, deadline_s=c.comm_timeout_ms / 1000,
                     connect_timeout_s=c.startup_timeout_s)
    comm = Communicator(spec.name, store, cfg, group=f"{group or spec.group}.kv")
    if pd_role(spec) == "prefill":
        comm.connect(send_to=decode)
    else:
        comm.connect(recv_from=prefill)
    return comm


# ---- the prefill side ---------------------------------------------------------------------------
@dataclass
class Outgoing:
    target: KVTarget
    next_block: int  # the first block not yet sent complete (every layer)
    start_ns: int = 0


class PrefillRunner(PipelinedRunner):
    """The pipeline of a prefill worker: as a layer's attention of a step ends, that layer's blocks of
    the step's transferred sequences go to their decode workers (``attended``)."""

    comm: Communicator
    max_blocks: int
    outgoing: dict[str, Outgoing]
    engine: Engine

    def transfer(self, comm: Communicator, max_blocks: int, engine: Engine) -> None:
        self.comm, self.max_blocks, self.engine, self.outgoing = comm, max_blocks, engine, {}

    def add(self, request_id: str, target: KVTarget) -> None:
        self.outgoing[request_id] = Outgoing(target, target.skip_blocks)

    def drop(self, request_id: str) -> None:
        self.outgoing.pop(request_id, None)

    def regroup(self, comm: Communicator) -> None:
        """New links: what was on its way is lost, so the next chunk of each transfer sends every block
        computed so far (a decode worker that dropped the reservation ignores it)."""
        self.comm = comm
        for out in self.outgoing.values():
            out.next_block = out.target.skip_blocks

    def attended(self, layer: int, batch: Batch | None) -> None:
        if batch is None or not self.outgoing:
            return
        now, bs, last = time.time_ns(), self.kv.block_size, layer == self.model.cfg.num_layers - 1
        blocks = self.engine.blocks
        for seq, n in zip(batch.seqs, batch.num_new):
            out = self.outgoing.get(seq.request_id)
            if out is None or seq.finished:
                continue
            out.start_ns = out.start_ns or now
            end = seq.num_computed + n
            table = blocks.block_table(seq.seq_id)
            top = -(-end // bs)
            with self.tracer.span("kv_send", layer=layer, blocks=top - out.next_block):
                for a in range(out.next_block, top, self.max_blocks):
                    b = min(top, a + self.max_blocks)
                    ids = torch.tensor(table[a:b], dtype=torch.int64, device=self.kv.tensors()[0].device)
                    msg = KVBlocks(out.target.handle, layer, a, min(end, b * bs), now, out.start_ns,
                                   self.kv.read_layer_blocks(layer, ids))
                    self.comm.send(worker_name("attention", out.target.decode), msg.tensors(), msg.meta())
            if last:
                out.next_block = max(out.next_block, end // bs)  # (never into the blocks it skips)
                if end == seq.num_tokens:
                    del self.outgoing[seq.request_id]


# ---- the decode side ----------------------------------------------------------------------------
@dataclass
class Incoming:
    request_id: str
    prompt: list[int]
    seq_id: int
    cached: int  # prompt tokens its prefix cache held
    done: list[int]  # per layer: prompt tokens landed
    adopt: AdoptKV | None = None
    start_ns: int = 0
    last_ns: int = 0
    landed_ns: int = 0
    table: torch.Tensor | None = None


@dataclass
class KVReceiver:
    comm: Communicator
    engine: Engine
    kv: KVCache
    incoming: dict[int, Incoming] = field(default_factory=dict)  # by handle
    queued: list[ReserveKV] = field(default_factory=list)  # waiting for free blocks
    landed: deque[KVLanded] = field(default_factory=lambda: deque(maxlen=LANDED_KEPT))  # since the last stats
    broken: bool = False  # a prefill peer failed: nothing is read until the links are new
    adopted: bool = False  # a request was adopted since the caller last looked
    _handles: int = 0

    @property
    def expecting(self) -> bool:
        return any(not inc.landed_ns for inc in self.incoming.values())

    def reserved_blocks(self) -> int:
        return sum(len(self.engine.blocks.tables.get(inc.seq_id, ())) for inc in self.incoming.values())

    def reserve(self, msg: ReserveKV) -> list[KVReserved]:
        self.queued.append(msg)
        return self.retry()

    def retry(self) -> list[KVReserved]:
        """Reserves the queued prompts that fit now, in order."""
        out = []
        while self.queued and (r := self._reserve(self.queued[0])) is not None:
            self.queued.pop(0)
            out.append(r)
        return out

    def _reserve(self, msg: ReserveKV) -> KVReserved | None:
        blocks, n = self.engine.blocks, len(msg.prompt_token_ids)
        bs = blocks.block_size
        hit = PrefixHit()
        if blocks.enabled and blocks.salt is not None:
            hit = blocks.lookup(block_hashes(msg.prompt_token_ids, bs, blocks.salt), (n - 1) // bs)
        if not blocks.can_admit(hit, n):
            return None
        seq_id = self.engine.new_seq_id()
        cached = blocks.acquire(seq_id, hit, n)
        blocks.reserve(seq_id, n)
        self._handles += 1
        inc = Incoming(msg.request_id, msg.prompt_token_ids, seq_id, cached, [cached] * self.engine_layers())
        inc.table = torch.tensor(blocks.block_table(seq_id), dtype=torch.int64, device=self.kv.tensors()[0].device)
        self.incoming[self._handles] = inc
        return KVReserved("", msg.request_id, self._handles, cached // bs, msg.attempt)

    def engine_layers(self) -> int:
        return self.kv.tensors()[0].shape[0]

    def abort(self, request_id: str) -> bool:
        """Frees a reservation of ``request_id`` (queued or held); False if there is none."""
        before = len(self.queued)
        self.queued = [q for q in self.queued if q.request_id != request_id]
        for h, inc in list(self.incoming.items()):
            if inc.request_id == request_id:
                del self.incoming[h]
                self.engine.blocks.free(inc.seq_id)
                return True
        return len(self.queued) < before

    def adopt(self, msg: AdoptKV) -> None:
        inc = self.incoming.get(msg.handle)
        if inc is None:  # dropped when the links were renewed: the prompt is computed here
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params, msg.output_token_ids)
            self.adopted = True
            return
        inc.adopt = msg
        self._adopt_if_ready(msg.handle, inc)

    def poll(self, timeout: float) -> None:
        """Copies the KV blocks that arrived into the cache (waiting up to ``timeout`` for the first)."""
        if self.broken:
            return
        try:
            msg = self.comm.try_recv()
            if msg is None and timeout > 0:
                try:
                    msg = self.comm.recv_any(timeout=timeout)
                except TimeoutError:
                    return
            while msg is not None:
                self._land(read_kv(msg))
                msg = self.comm.try_recv()
        except PeerError:  # a prefill worker is gone: the front end re-routes its requests
            self.broken = True

    def _land(self, m: KVBlocks) -> None:
        try:
            inc = self.incoming.get(m.handle)
            if inc is None:
                return
            n = m.parts[0].shape[0]
            self.kv.write_layer_blocks(m.layer, inc.table[m.first:m.first + n], m.parts)
        finally:
            m.release()
        inc.done[m.layer] = max(inc.done[m.layer], m.end)
        inc.start_ns = inc.start_ns or m.start_ns
        total = len(inc.prompt)
        if m.layer == len(inc.done) - 1 and m.end == total:
            inc.last_ns = m.stamp_ns
        if min(inc.done) == total:
            inc.landed_ns = time.time_ns()
            self.landed.append(KVLanded(inc.request_id, total, int(inc.table.numel()), inc.start_ns, inc.last_ns,
                                        inc.landed_ns))
            self._adopt_if_ready(m.handle, inc)

    def _adopt_if_ready(self, handle: int, inc: Incoming) -> None:
        if inc.adopt is None or not inc.landed_ns:
            return
        del self.incoming[handle]
        self.adopted = True
        a = inc.adopt
        self.engine.adopt(a.request_id, inc.prompt, a.params, a.output_token_ids, inc.seq_id, inc.cached)

    def regroup(self, comm: Communicator) -> None:
        """New links: what was on its way over the old ones is lost, so every reservation not landed
        goes back (one whose first token came is computed here; a later ``AdoptKV`` of another too)."""
        self.comm, self.broken = comm, False
        for h, inc in list(self.incoming.items()):
            if inc.landed_ns:
                continue
            del self.incoming[h]
            self.engine.blocks.free(inc.seq_id)
            if inc.adopt is not None:
                self.adopt(inc.adopt)
