"""A disaggregated deployment as an ``EngineClient``: n_a attention workers and n_e expert workers,
as local processes or Ray actors (only the launcher differs).

The front end (this object, in the caller's process) validates and tokenizes requests, assigns each
to an attention worker, turns the workers' token ids into outputs (detokenization and stop strings
happen here, once) and reports stats. Workers talk to each other over the M2N library and to the
front end over typed control messages (``afdserve.runtime.messages``).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from dataclasses import replace
from multiprocessing.connection import wait
from typing import Any, Callable, Iterator

from afdserve.backends import host
from afdserve.balance.attention import AttentionBalancer
from afdserve.balance.load import LoadSnapshot
from afdserve.balance.placement import Placement
from afdserve.cluster.prefix_routing import PrefixRecord, place, record_capacity
from afdserve.cluster import rebalance, resize
from afdserve.cluster.process_launcher import start_store
from afdserve.cluster.cp import CPRouter
from afdserve.cluster.pd import PDRouter
from afdserve.cluster.supervisor import MAX_CRASHES_PER_REQUEST, CrashCounts, Heartbeats, Membership, serve_around
from afdserve.cluster.worker_stats import ClusterStats
from afdserve.config import EngineConfig
from afdserve.engine.builder import context_len, front_end_tokenizer, prefix_config, resolve_model
from afdserve.engine.client import RebalanceResult, ScaleResult
from afdserve.engine.frontend import FrontEnd
from afdserve.engine.outputs import TokenOutput
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.stats import EngineStats
from afdserve.errors import ConfigError, WorkerError
from afdserve.model.config import ModelConfig
from afdserve.planner import attention_request_cost
from afdserve.runtime.expert_map import ExpertMap
from afdserve.runtime.links import max_micro_batches
from afdserve.runtime.messages import (AbortRequests, Ack, AddRequest, Crashed,
                                       FromWorker, GetStats, GetTrace, KVReserved, PeerLost, Ready, Regroup, SetMicroBatches,
                                       Shutdown, StatsReply, StepOutputs, ToWorker, TraceReply, WorkerSpec, batched)
from afdserve.runtime.trace import write_chrome_trace

log = logging.getLogger("afdserve.cluster")


class ClusterClient(FrontEnd):
    def __init__(self, cfg: EngineConfig, launch: Callable[[WorkerSpec], Any]):
        self.config = cfg
        path = resolve_model(cfg.model)
        self.model_cfg = ModelConfig.from_pretrained(path)
        tok = front_end_tokenizer(cfg, path, self.model_cfg)
        super().__init__(tok, self.model_cfg.vocab_size, context_len(cfg, self.model_cfg), id_prefix="c")
        if cfg.expert_workers < 1:
            raise ConfigError("a cluster needs at least one expert worker (expert_workers=0 is the colocated engine)")
        self.expert_map = ExpertMap.contiguous(self.model_cfg.num_layers, self.model_cfg.num_experts,
                                               cfg.expert_workers, cfg.expert_split)
        self.map_version = 0
        self.micro_batches = cfg.micro_batches
        self.max_micro_batches = max_micro_batches(cfg.micro_batches)
        self._launch = launch
        self._store = start_store(getattr(launch, "store_host", "127.0.0.1"))
        group = f"{os.getpid()}_{secrets.token_hex(3)}"
        self.membership = Membership(group)
        # what local workers share of this machine, for their backend (afdserve.backends.host)
        self.share = host.create_share(cfg)
        self.heartbeats = Heartbeats(cfg.heartbeat_timeout_ms / 1000)
        self.can_replace = bool(getattr(launch, "can_replace", True))  # a lost worker is replaced (else: fail)
        specs = [WorkerSpec(role, i, cfg, str(path), self.expert_map, self._store.addr, group,
                            frozenset(tok.eos_token_ids), trace=bool(cfg.trace),
                            host_share=self.share.fd if self.share is not None else None)
                 for role, n in (("attention", cfg.attention_workers), ("expert", cfg.expert_workers))
                 for i in range(n)]
        self.attention = [s.name for s in specs if s.role == "attention"]
        self.experts = [s.name for s in specs if s.role == "expert"]
        self.specs = {s.name: s for s in specs}
        self.workers: dict[str, Any] = {}  # name -> launched handle (ControlLink: send, ctl, dead, pid...)
        self.failed: str | None = None
        self.owner: dict[str, str] = {}  # request id -> attention worker
        self.lengths: dict[str, int] = {}  # request id -> tokens so far (for attention balance)
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}  # request id -> what to re-admit
        self.crashes = CrashCounts()  # requests in flight through worker crashes (a fault they trigger fails them)
        self.balancer = AttentionBalancer(list(self.attention), attention_request_cost(cfg.attention_cost)) \
            if cfg.attention_cost else AttentionBalancer(list(self.attention))
        prefix = prefix_config(cfg, path)  # cache-aware routing: where each request's prompt blocks went
        self.routes = PrefixRecord(self.attention, cfg.block_size, prefix.salt,
                                   record_capacity(cfg, self.model_cfg, self.max_model_len)) \
            if prefix is not None else None  # (one attention worker: kept for a resize that adds more)
        self.pd = PDRouter(self) if cfg.prefill_workers else None  # prefill/decode disaggregation
        self.cp = CPRouter(self) if cfg.context_parallel_size > 1 else None  # context-parallel prefill (not with P/D)
        self.stats_view = ClusterStats(self.attention, self.experts, cfg.num_threads or 1)
        self._held: list[TokenOutput] = []  # outputs that arrived during a control call
        self._closed = False
        try:
            prepare = getattr(launch, "prepare", None)  # e.g. reserve a placement group for all workers
            if prepare is not None:
                prepare(specs)
            for s in specs:
                self.workers[s.name] = launch(s)
            self._wait_ready(cfg.startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ---- lifecycle ------------------------------------------------------------------------------
    def _wait_ready(self, timeout: float) -> None:
        pending = set(self.workers)
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"workers {sorted(pending)} did not start within {timeout:.0f} s")
            for name, msg in self._receive(pending, left):
                if msg is None:
                    self.workers[name].wait(5)
                    raise WorkerError(f"{self._who(name)} exited during start-up ({self.workers[name].exit_status()})")
                if isinstance(msg, Ready):
                    pending.discard(name)
                    log.info("worker %s ready (%d/%d)", self._who(name), len(self.workers) - len(pending),
                             len(self.workers))
                elif isinstance(msg, Crashed):
                    raise WorkerError(f"{self._who(name)} failed to start: {msg.error}\n{msg.traceback}")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.config.trace and self.workers and not self.failed:
            try:
                write_chrome_trace(self.config.trace, self.traces())
            except Exception:
                pass
        for w in self.workers.values():  # attention workers first: they stop sending
            w.send(Shutdown())
        for w in self.workers.values():
            w.join(5.0)
        close = getattr(self._launch, "close", None)  # e.g. release the placement group
        if close is not None:
            close()
        self._store.close()
        if self.share is not None:
            self.share.close()

    # ---- FrontEnd: requests to the attention workers -----------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.submit_many([(request_id, prompt_token_ids, params)])

    def submit_many(self, requests: list[tuple[str, list[int], SamplingParams]]) -> None:
        """Each attention worker gets its share at once (``AddRequests``); all or nothing."""
        if self.failed:
            raise WorkerError(f"deployment failed: {self.failed}")
        adds: dict[str, list[AddRequest]] = {}
        try:
            for rid, ids, params in requests:
                if self.pd is not None:  # to a prefill worker once a decode worker holds its blocks
                    self.pd.submit(rid, ids, params)
                elif self.cp is None or not self.cp.submit(rid, ids, params, adds):  # CP: to several workers
                    target = place(self.balancer, self.routes, rid, ids, params.max_tokens, len(self.attention) > 1)
                    self.owner[rid], self.lengths[rid], self.requests[rid] = target, len(ids), (ids, params)
                    adds.setdefault(target, []).append(AddRequest(rid, ids, params))
            for target, batch in adds.items():
                for msg in batched(batch):
                    self.workers[target].send(msg)
        except BaseException:
            for rid, _, _ in requests:  # none stays queued (an abort of one not sent is a no-op)
                self.cancel(rid)
            raise

    def cancel(self, request_id: str) -> None:
        target = self._release(request_id)
        if target is not None:
            self.workers[target].send(AbortRequests([request_id]))

    def poll(self, timeout: float) -> list[TokenOutput]:
        """Token outputs that arrived (waits up to ``timeout`` for the first)."""
        outs, self._held = self._held, []
        if outs:
            timeout = 0.0
        for name, msg in self._receive(self._live(), timeout):
            outs += self._handle(name, msg)
        return outs + self._fence_stalled()

    def _fence_stalled(self) -> list[TokenOutput]:
        """Fences and replaces every worker that is up but silent past ``heartbeat_timeout_ms``: a
        stopped attention worker is caught here (a stopped expert also by its peers' deadline)."""
        live = [n for n in self._live() if not self.membership.pending(n)]
        outs: list[TokenOutput] = []
        for name, silent in self.heartbeats.stalled(live):
            if self.workers[name].dead or self.membership.pending(name):  # replaced by an earlier one
                continue
            outs += self._lost(name, f"{self._who(name)} stalled: no heartbeat for {silent:.1f} s")
        return outs

    def _release(self, request_id: str) -> str | None:
        self.crashes.progressed(request_id)
        target = self.owner.pop(request_id, None)
        self.lengths.pop(request_id, None)
        self.requests.pop(request_id, None)
        if (router := self.pd or self.cp) is not None:  # what the request holds on other workers
            router.forget(request_id)
        if target is not None:
            self.balancer.remove(target, request_id)
        return target

    def _handle(self, name: str, msg: FromWorker | None) -> list[TokenOutput]:
        if msg is None:  # the control channel broke: the process is gone
            w = self.workers[name]
            w.wait(0.2)
            return self._lost(name, f"{self._who(name)} died ({w.exit_status()})")
        if isinstance(msg, StepOutputs):
            self.stats_view.on_step(name, msg.stats)
            outs = msg.outputs if (router := self.pd or self.cp) is None else router.outputs(name, msg.outputs)
            for o in outs:
                if o.finished:
                    self._release(o.request_id)
                elif o.request_id in self.lengths:
                    if o.new_token_ids:
                        self.crashes.progressed(o.request_id)
                    self.lengths[o.request_id] += len(o.new_token_ids)
                    self.balancer.update(name, o.request_id, self.lengths[o.request_id])
            return outs
        if isinstance(msg, KVReserved):
            self.pd.reserved(msg)
            return []
        if isinstance(msg, Crashed):
            return self._lost(name, msg.error, crashed=True)
        if isinstance(msg, PeerLost):  # a report from an older epoch is about links already replaced
            if msg.epoch < self.membership.epoch or msg.peer not in self.workers:
                return []
            lost = self.workers[msg.peer]  # its own report first: one that raised sent it before its peers saw it go
            outs = [o for name, m in self._receive([msg.peer], 0.0) for o in self._handle(name, m)]
            replaced = self.workers.get(msg.peer) is not lost  # by that report, or by the end of its channel
            return outs if replaced else outs + self._lost(msg.peer, f"{msg.worker} lost it: {msg.reason}")
        if isinstance(msg, Ready) and msg.epoch == self.membership.epoch and self.membership.recovery is not None:
            self.membership.ready(name)
            self.heartbeats.heard(name)
            if self.membership.recovery is None and self.membership.degraded_since is not None:
                self._rejoin()
        if isinstance(msg, StatsReply):
            self.stats_view.on_stats(name, msg.stats)
        return []

    def _lost(self, name: str, reason: str, crashed: bool = False) -> list[TokenOutput]:
        """A worker died, crashed or stalled past its peers' deadline: fence it and replace it in a new
        membership epoch (``afdserve.cluster.supervisor``); requests go on. Where workers cannot be
        replaced (Ray), or a replacement keeps dying before it is ready, every request fails instead.
        A request in flight through ``MAX_CRASHES_PER_REQUEST`` crashes (``crashed``: an error the
        worker raised) with no token between them fails with that error: what a request triggers
        every time must not restart a worker forever."""
        if self._closed or self.failed:
            return []
        if not self.can_replace:
            return self._fail_all(name, reason)
        if self.membership.pending(name) and self.membership.start_failed(name):
            return self._fail_all(name, f"{self._who(name)} could not be restarted: {reason}")
        outs = self._fail_crashed(name, reason) if crashed else []
        self.workers[name].kill()
        survivors = [n for n in self.workers if n != name and not self.membership.pending(n)]
        rec = self.membership.begin(name, reason, survivors)
        group = self.membership.group_of(rec.epoch)
        missing = serve_around(rec.starting, self.experts, self.config, self.expert_map)
        rec.degraded = bool(missing)
        for n in survivors:  # first: with missing workers, the others serve on while the replacements start
            self.workers[n].send(Regroup(rec.epoch, group, len(self.attention), len(self.experts), missing=missing))
        for n in sorted(rec.starting):  # replacements still starting are in an older epoch: start them anew
            if n != name:
                self.workers[n].kill()
            spec = replace(self.specs[n], config=self.config, group=group, epoch=rec.epoch, deferred=bool(missing),
                           expert_map=self.expert_map, map_version=self.map_version)
            self.workers[n] = self._launch(spec)
            if n in self.attention:
                if self.routes is not None:
                    self.routes.forget(n)  # a new process: its prefix cache is empty
                (self._readmit if (router := self.pd or self.cp) is None else router.readmit)(n)
        return outs

    def _fail_crashed(self, name: str, reason: str) -> list[TokenOutput]:
        """Counts a crash of worker ``name`` against the requests it interrupted (an attention worker's
        own; every request for an expert worker) and fails those that reached the limit."""
        hit = [rid for rid, owner in self.owner.items() if owner == name or name not in self.attention]
        outs = []
        for rid in self.crashes.crashed(hit):
            owner = self._release(rid)
            if owner is not None and owner != name:
                self.workers[owner].send(AbortRequests([rid]))
            outs.append(TokenOutput(rid, [], "abort", error=f"worker failure: {self._who(name)} crashed "
                                    f"{MAX_CRASHES_PER_REQUEST} times with this request in flight: {reason}"))
        return outs

    def _rejoin(self) -> None:
        """After a degraded epoch: every worker, the loaded replacements included, connects again."""
        rec = self.membership.rejoin(list(self.workers))
        group = self.membership.group_of(rec.epoch)
        for w in self.workers.values():
            w.send(Regroup(rec.epoch, group, len(self.attention), len(self.experts)))

    def _readmit(self, worker: str) -> None:
        """Hands the requests of a lost attention worker to its replacement: prompt plus the tokens
        already generated, recomputed (the front end has every token it sent on; none repeats)."""
        for rid, owner in self.owner.items():
            if owner == worker:
                prompt, params = self.requests[rid]
                self.workers[worker].send(AddRequest(rid, prompt, params, self.delivered(rid)))
                if self.routes is not None:  # recomputed there: its prompt blocks will be cached there
                    self.routes.add(worker, self.routes.key(prompt))

    def delivered(self, request_id: str) -> list[int]:
        """The tokens of an engine request that reached this front end (taken in, or held from a control call)."""
        held = [t for o in self._held if o.request_id == request_id for t in o.new_token_ids]
        return self.outputs.tokens_so_far(request_id) + held

    # ---- membership changes on request ----------------------------------------------------------
    def scale(self, attention_workers: int | None = None, expert_workers: int | None = None,
              timeout: float = 300.0) -> ScaleResult:
        """Resizes the attention and/or expert pool while serving (``afdserve.cluster.resize``)."""
        return resize.scale(self, attention_workers, expert_workers, timeout)

    def launch_worker(self, spec: WorkerSpec) -> Any:
        return self._launch(spec)

    def settle(self, timeout: float) -> None:
        """Waits until the membership change under way (a replacement, a resize) is complete; outputs
        arriving meanwhile are kept for the next ``get_outputs``."""
        deadline = time.monotonic() + timeout
        while (rec := self.membership.recovery) is not None and not self.failed:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"membership epoch {rec.epoch} not complete within {timeout:.0f} s: waiting "
                                  f"for {sorted(rec.starting | rec.regrouping)}")
            for name, m in self._receive(self._live(), min(left, 0.1)):
                self._held += self._handle(name, m)

    def _fail_all(self, name: str | None, reason: str) -> list[TokenOutput]:
        """Fails every in-flight request with an error naming the failed worker."""
        remote = [n for n, w in self.workers.items() if getattr(w, "remote", False)
                  and (n == name or _names(n, reason)) and self._who(n) not in reason]
        if remote:  # say where the failed worker (or the peer a report names) ran
            reason += " [" + "; ".join(self._who(n) for n in remote) + "]"
        if self.failed is None:
            self.failed = reason
        outs = [TokenOutput(rid, [], "abort", error=f"worker failure: {reason}") for rid in list(self.owner)]
        for o in outs:
            self._release(o.request_id)
        if name is not None and name in self.workers:
            self.workers[name].dead = True
        return outs

    # ---- control calls ------------------------------------------------------------------------
    def _live(self) -> list[str]:
        return [n for n, w in self.workers.items() if not w.dead]

    def _receive(self, names: Any, timeout: float) -> Iterator[tuple[str, FromWorker | None]]:
        """Messages that are ready from the workers ``names`` (waits up to ``timeout`` for the first);
        ``None`` for a worker whose channel broke. Read one at a time, so that nothing is read from a
        worker that was replaced while an earlier message was handled."""
        handles = {self.workers[n].ctl.conn: (n, self.workers[n]) for n in names if not self.workers[n].dead}
        for conn in wait(list(handles), timeout=timeout):
            name, w = handles[conn]
            while self.workers.get(name) is w and not w.dead and w.ctl.poll(0):
                try:
                    msg = w.ctl.recv()
                except (EOFError, OSError):
                    w.dead = True
                    yield name, None
                    break
                self.heartbeats.heard(name)
                yield name, msg  # type: ignore[misc]

    def call(self, targets: list[str], msg: ToWorker | Callable[[int], ToWorker], reply: type,
              timeout: float = 120.0) -> dict[str, Any]:
        """Sends ``msg`` (or ``msg(i)`` to the i-th target) to ``targets`` and waits for each one's
        ``reply`` message (outputs arriving meanwhile are kept for the next ``get_outputs``)."""
        for i, t in enumerate(targets):
            self.workers[t].send(msg(i) if callable(msg) else msg)
        got: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(targets):
            if self.failed:
                raise WorkerError(f"deployment failed: {self.failed}")
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(targets) - set(got))
                raise WorkerError(f"workers {missing} did not answer {reply.__name__} within {timeout:.0f} s")
            for name, m in self._receive(self._live(), min(left, 0.1)):
                if isinstance(m, reply) and name in targets:
                    got[name] = m
                else:
                    self._held += self._handle(name, m)
        return got

    def expert_load(self) -> LoadSnapshot | None:
        """Tokens per expert and co-activation over the recent window, merged over the workers."""
        snaps = [LoadSnapshot.from_json(st.load) for st in self.worker_stats().values() if st.load is not None]
        return LoadSnapshot.merge(snaps) if snaps else None

    def rebalance(self, slots_per_worker: int | None = None, planner: str = "janus",
                  placement: Placement | None = None) -> RebalanceResult:
        """Moves expert weights to ``placement`` (default: planned from the recent load, with
        ``slots_per_worker`` slots each) while serving: expert workers first load the new experts
        next to the old ones, then every attention worker switches maps between two steps, then
        the experts no longer needed are dropped. No request fails and no output changes."""
        return rebalance.move_experts(self, slots_per_worker, planner, placement)

    def set_micro_batches(self, m: int) -> None:
        """Changes how many micro-batches every attention worker splits its batch into, from the
        next step on (the deployment keeps its processes, links and caches)."""
        if not 1 <= m <= self.max_micro_batches:
            raise ConfigError(f"micro_batches must be in 1..{self.max_micro_batches} (the links were sized "
                              f"at start-up for micro_batches={self.max_micro_batches}), got {m}")
        self.call(self.attention, SetMicroBatches(m), Ack)
        self.micro_batches = m

    # ---- introspection ------------------------------------------------------------------------
    def worker_stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """Every live worker's stats (``AttentionStats`` or ``ExpertStats``), asked for and awaited."""
        got = self.call(self._live(), GetStats(), StatsReply, timeout)
        for name, m in got.items():
            self.stats_view.on_stats(name, m.stats)
        return {name: m.stats for name, m in got.items()}

    def traces(self, timeout: float = 10.0) -> dict[str, list[dict]]:
        """Every live worker's trace events since the last call (numbered rows of one trace)."""
        got = self.call(sorted(self._live()), GetTrace, TraceReply, timeout)
        return {name: m.events for name, m in sorted(got.items())}

    def stats(self) -> EngineStats:
        m = self.membership
        state = {n: "down" if self.failed and w.dead else m.state.get(n, "up") for n, w in self.workers.items()}
        return replace(self.stats_view.snapshot(), workers=state, restarts=dict(m.restarts),
                       last_failure=dict(m.last_failure))

    def refresh_stats(self) -> None:
        """Reads the workers' CPU time and asks every worker for its stats without waiting: the
        replies land during ``get_outputs`` (no output is held back meanwhile)."""
        self.stats_view.refresh({n: w.pid for n, w in self.workers.items() if not w.dead})
        for w in self.workers.values():
            w.send(GetStats())

    def _who(self, name: str) -> str:
        """``expert1 (pid 123)``; workers on other machines say which node too."""
        return f"{name} ({self.workers[name].describe()})"


def _names(name: str, text: str) -> bool:
    return re.search(rf"\b{name}\b", text) is not None
