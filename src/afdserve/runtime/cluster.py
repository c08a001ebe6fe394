"""The local cluster: a disaggregated deployment as worker processes on this machine.

The front end (this object, in the caller's process) validates and tokenizes requests, assigns
each to an attention worker, and gathers outputs. Workers talk to each other over the M2N
library; the front end talks to them over control pipes. Workers die with their parent.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from afdserve.config import EngineConfig
from afdserve.engine.engine import validate_prompt
from afdserve.engine.outputs import RequestOutput
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.tokenizer import load_tokenizer
from afdserve.errors import RequestError, WorkerError
from afdserve.model.config import ModelConfig
from afdserve.balance.attention import AttentionBalancer
from afdserve.balance.load import LoadSnapshot
from afdserve.balance.placement import Placement
from afdserve.runtime.deltas import DeltaDecoder
from afdserve.runtime.expert_map import ExpertMap
from afdserve.runtime.links import max_micro_batches
from afdserve.runtime.launcher import Launched, spawn_worker, start_store
from afdserve.runtime.trace import write_chrome_trace
from afdserve.runtime.workers import WorkerSpec


class LocalCluster:
    """Engine-shaped front end (tokenize / add_request / step / abort / has_unfinished / shutdown)
    over n_a attention workers and n_e expert workers."""

    def __init__(self, cfg: EngineConfig, launch: Any = None):
        from afdserve.engine.builder import context_len, resolve_model

        self.cfg = cfg
        path = resolve_model(cfg.model)
        self.model_cfg = ModelConfig.from_pretrained(path)
        self.max_model_len = context_len(cfg, self.model_cfg)
        self.tok = load_tokenizer(Path(cfg.tokenizer) if cfg.tokenizer else path, self.model_cfg.eos_token_ids)
        n_e = cfg.expert_workers
        if n_e < 1:
            raise WorkerError("a cluster needs at least one expert worker (expert_workers=0 is the colocated engine)")
        self.expert_map = ExpertMap.contiguous(self.model_cfg.num_layers, self.model_cfg.num_experts, n_e,
                                               cfg.expert_split)
        self.group = f"{os.getpid()}_{secrets.token_hex(3)}"
        if launch is None and (cfg.cluster != "local" or cfg.deployment):  # Ray actors, spec's threads
            from afdserve.cluster import make_launcher

            launch = make_launcher(cfg)
        self._launch = launch or spawn_worker
        self._store = start_store(getattr(self._launch, "store_host", "127.0.0.1"))
        specs = [WorkerSpec("attention", i, cfg, str(path), self.expert_map, self._store.addr, self.group,
                            trace=bool(cfg.trace)) for i in range(cfg.attention_workers)]
        specs += [WorkerSpec("expert", j, cfg, str(path), self.expert_map, self._store.addr, self.group,
                             trace=bool(cfg.trace)) for j in range(n_e)]
        self.workers: dict[str, Launched] = {}
        self.failed: str | None = None
        self.owner: dict[str, str] = {}  # request id -> attention worker
        self.load: dict[str, int] = {}  # attention worker -> outstanding requests
        self.stats: dict[str, dict] = {}
        self._ids = itertools.count()
        self._closed = False
        try:
            prepare = getattr(self._launch, "prepare", None)  # e.g. reserve a placement group for all workers
            if prepare is not None:
                prepare(specs)
            for s in specs:
                self.workers[s.name] = self._launch(s)
            self._wait_ready(cfg.startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.attention = [s.name for s in specs if s.role == "attention"]
        self.experts = [s.name for s in specs if s.role == "expert"]
        self.load = {a: 0 for a in self.attention}
        self.balancer = AttentionBalancer.from_profile(self.attention, cfg.attention_cost) if cfg.attention_cost \
            else AttentionBalancer(self.attention)
        self.map_version = 0
        self.micro_batches = cfg.micro_batches
        self.max_micro_batches = max_micro_batches(cfg.micro_batches)
        self._buffer: list[RequestOutput] = []
        self.outputs = DeltaDecoder()

    # ---- lifecycle ------------------------------------------------------------------------
    def _wait_ready(self, timeout: float) -> None:
        pending = set(self.workers)
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"workers {sorted(pending)} did not start within {timeout:.0f} s")
            conns = {self.workers[n].conn: n for n in pending}
            for r in wait(list(conns), timeout=left):
                name = conns[r]
                w = self.workers[name]
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    w.wait(5)
                    raise WorkerError(f"{self._who(name)} exited during start-up ({w.exit_status()})")
                if msg[0] == "ready":
                    pending.discard(name)
                elif msg[0] == "crash":
                    raise WorkerError(f"{self._who(name)} failed to start: {msg[2]}\n{msg[3]}")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.cfg.trace and self.workers and not self.failed:
            try:
                self.write_trace(self.cfg.trace)
            except Exception:
                pass
        for w in self.workers.values():  # attention workers first: they stop sending
            w.send(("stop",))
        for w in self.workers.values():
            w.join(5.0)
        close = getattr(self._launch, "close", None)  # e.g. release the placement group
        if close is not None:
            close()
        self._store.close()

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: str | dict | list[int]) -> tuple[str | None, list[int]]:
        return validate_prompt(prompt, self.tok, self.model_cfg.vocab_size, self.max_model_len)

    def add_request(self, prompt: str | dict | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        text, ids = self.tokenize(prompt)
        rid = request_id if request_id is not None else f"c{next(self._ids)}"
        if rid in self.owner:
            raise RequestError(f"duplicate request id {rid!r}")
        if self.failed:
            raise WorkerError(f"deployment failed: {self.failed}")
        params = params or SamplingParams()
        target = self.balancer.pick(len(ids), params.max_tokens)  # least predicted attention time
        self.balancer.add(target, rid, len(ids))
        self.owner[rid] = target
        self.load[target] += 1
        self.outputs.add(rid, text, ids)
        self.workers[target].send(("add", rid, ids, text, params))
        return rid

    def abort(self, request_id: str) -> None:
        target = self.owner.pop(request_id, None)
        if target is not None:
            self.load[target] -= 1
            self.balancer.remove(target, request_id)
            self.outputs.drop(request_id)
            self.workers[target].send(("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self.owner)

    def step(self, timeout: float = 1.0) -> list[RequestOutput]:
        """Outputs that arrived (waits up to ``timeout`` for the first)."""
        if self._buffer:
            outs, self._buffer = self._buffer, []
            return outs
        outs = []
        conns = {w.conn: n for n, w in self.workers.items() if not w.dead}
        for r in wait(list(conns), timeout=timeout):
            name = conns[r]
            w = self.workers[name]
            while not w.dead and w.conn.poll(0):
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):  # the process is gone
                    try:
                        w.wait(0.2)
                    except Exception:
                        pass
                    outs += self._worker_died(name, f"{self._who(name)} died ({w.exit_status()})")
                    break
                outs += self._handle(name, msg)
        return outs

    def _handle(self, name: str, msg: tuple) -> list[RequestOutput]:
        kind = msg[0]
        if kind == "out":
            self.stats[name] = msg[2]
            outs = [self.outputs.decode(d) for d in msg[1]]
            for o in outs:
                if o.finished:
                    if self.owner.pop(o.request_id, None) is not None:
                        self.load[name] -= 1
                    self.balancer.remove(name, o.request_id)
                elif o.outputs:
                    self.balancer.update(name, o.request_id, len(o.prompt_token_ids) + len(o.outputs[0].token_ids))
            return outs
        if kind in ("failed", "crash"):
            return self._worker_died(name if kind == "crash" else None, msg[2])
        if kind == "stats":
            self.stats[msg[1]] = msg[2]
        return []

    # ---- expert placement -------------------------------------------------------------------
    def _call(self, targets: list[str], msg: tuple, timeout: float = 120.0) -> None:
        """Sends ``msg`` to ``targets`` and waits for each one's ack (outputs arriving meanwhile
        are kept for the next ``step``)."""
        for t in targets:
            self.workers[t].send(msg)
        pending = set(targets)
        deadline = time.monotonic() + timeout
        while pending:
            if self.failed:
                raise WorkerError(f"deployment failed: {self.failed}")
            if time.monotonic() > deadline:
                raise WorkerError(f"workers {sorted(pending)} did not acknowledge {msg[0]!r} within {timeout:.0f} s")
            conns = {self.workers[n].conn: n for n in self.workers if not self.workers[n].dead}
            for r in wait(list(conns), timeout=0.1):
                name, w = conns[r], self.workers[conns[r]]
                while not w.dead and w.conn.poll(0):
                    try:
                        got = w.conn.recv()
                    except (EOFError, OSError):
                        self._buffer += self._worker_died(name, f"{self._who(name)} died")
                        break
                    if got[0] == "ack" and name in pending:
                        pending.discard(name)
                    else:
                        self._buffer += self._handle(name, got)

    def expert_load(self) -> LoadSnapshot | None:
        """Tokens per expert and co-activation over the recent window, merged over the workers."""
        snaps = [LoadSnapshot.from_json(st["load"]) for st in self.collect("stats").values() if "load" in st]
        return LoadSnapshot.merge(snaps) if snaps else None

    def rebalance(self, placement: Placement | None = None, slots_per_worker: int | None = None,
                  planner: str = "janus") -> ExpertMap:
        """Moves expert weights to ``placement`` (default: planned from the recent load, with
        ``slots_per_worker`` slots each) while serving: expert workers first load the new experts
        next to the old ones, then every attention worker switches maps between two steps, then
        the experts no longer needed are dropped. No request fails and no output changes."""
        if placement is None:
            from afdserve.balance.planners import plan_janus, plan_megascale

            load = self.expert_load()
            if load is None:
                raise WorkerError("no expert load recorded yet: serve some requests first")
            cur = self.expert_map.placement.layers[0].capacities
            slots = slots_per_worker or max(cur)
            plan = plan_janus if planner == "janus" else plan_megascale
            placement = plan(load, len(self.experts), slots)
        new_map = ExpertMap(placement)
        if new_map.num_workers != len(self.experts) or new_map.num_layers != self.model_cfg.num_layers:
            raise WorkerError(f"placement is for {new_map.num_workers} workers x {new_map.num_layers} layers; "
                              f"the deployment has {len(self.experts)} x {self.model_cfg.num_layers}")
        placement.validate()
        version = self.map_version + 1
        self._call(self.experts, ("prepare", version, new_map))
        self._call(self.attention, ("set_map", version, new_map))
        self._call(self.experts, ("commit", version))
        self.map_version, self.expert_map = version, new_map
        return new_map

    def set_micro_batches(self, m: int) -> None:
        """Changes how many micro-batches every attention worker splits its batch into, from the
        next step on (the deployment keeps its processes, links and caches)."""
        if not 1 <= m <= self.max_micro_batches:
            raise ValueError(f"micro_batches must be in 1..{self.max_micro_batches} (the links were sized "
                             f"at start-up for micro_batches={self.max_micro_batches}), got {m}")
        self._call(self.attention, ("set_micro_batches", m))
        self.micro_batches = m

    def _who(self, name: str) -> str:
        """``expert1 (pid 123)``; workers on other machines say which node too."""
        return f"{name} ({self.workers[name].describe()})"

    def _worker_died(self, name: str | None, reason: str) -> list[RequestOutput]:
        """Fails every in-flight request with an error naming the failed worker."""
        remote = [n for n, w in self.workers.items() if getattr(w, "remote", False)
                  and (n == name or re.search(rf"\b{n}\b", reason)) and self._who(n) not in reason]
        if remote:  # say where the failed worker (or the peer a report names) ran
            reason += " [" + "; ".join(self._who(n) for n in remote) + "]"
        if self.failed is None:
            self.failed = reason
        outs = []
        for rid in list(self.owner):
            self.owner.pop(rid)
            self.outputs.drop(rid)
            outs.append(RequestOutput(rid, None, [], [], finished=True, error=f"worker failure: {reason}"))
        self.load = {a: 0 for a in self.load}
        if name is not None and name in self.workers:
            self.workers[name].dead = True
        return outs

    # ---- introspection --------------------------------------------------------------------
    def collect(self, kind: str, timeout: float = 10.0) -> dict[str, Any]:
        """Asks every live worker for its ``trace`` or ``stats``."""
        live = {n: w for n, w in self.workers.items() if not w.dead}
        for tid, (n, w) in enumerate(sorted(live.items())):
            w.send((kind, tid) if kind == "trace" else (kind,))
        got: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(live) and time.monotonic() < deadline:
            for r in wait([w.conn for w in live.values()], timeout=0.1):
                n = next(k for k, w in live.items() if w.conn is r)
                msg = r.recv()
                if msg[0] == kind:
                    got[msg[1]] = msg[2]
                else:
                    self._handle(n, msg)
        return got

    def request_stats(self) -> None:
        """Asks every live worker for its stats without waiting: the replies land in ``self.stats``
        during ``step`` (unlike ``collect``, no output is held back meanwhile)."""
        for w in self.workers.values():
            w.send(("stats",))

    def write_trace(self, path: str) -> None:
        write_chrome_trace(path, self.collect("trace"))
