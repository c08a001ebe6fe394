"""The autoscaling loop of ``afdserve serve --autoscale``: samples the server's signals, asks the
policy (``afdserve.planner.autoscale.AutoscalePolicy``) and applies its decision with the live resize
(``EngineClient.scale``, the call behind ``POST /admin/scale``), in the engine thread between steps.

Signals, every ``interval_s``: waiting and running requests, the fullest attention worker's KV
usage and each pool's mean busy fraction (the engine's ``EngineStats`` snapshot), and over the
interval the mean time between tokens (TPOT), the mean time to first token and the decode tokens
per second (the deltas of the server's own histograms). The loop never stops the server: a
failed or timed-out resize is logged and counted, the sizes are re-read from the deployment, and
the next try comes after the cool-down; any other error in a turn is logged and the next turn
comes. It stops once the server drains (``closing``) or ``stop`` is called.

Metrics (in the server's registry): ``afdserve_autoscale_pool_workers{pool}``,
``afdserve_autoscale_decisions_total{action,pool,reason}`` (every sample's decision),
``afdserve_autoscale_last_resize_timestamp_seconds``, ``afdserve_autoscale_resize_failures_total``
and ``afdserve_autoscale_signal{signal}`` (the last sample).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from dataclasses import asdict
from typing import Any, Callable

from prometheus_client import Counter, Gauge

from afdserve.planner.autoscale import AutoscalePolicy, Decision, Signals
from afdserve.serving.async_engine import AsyncEngine
from afdserve.serving.metrics import ServingMetrics

log = logging.getLogger("afdserve.serving.autoscale")
TIMELINE_SAMPLES = 10_000  # kept in memory (the JSON-lines file keeps all)


class Autoscaler:
    def __init__(self, engine: AsyncEngine, metrics: ServingMetrics, policy: AutoscalePolicy, *,
                 interval_s: float = 1.0, resize_timeout_s: float = 300.0, timeline_path: str | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.engine, self.metrics, self.policy = engine, metrics, policy
        self.interval_s, self.resize_timeout_s, self.timeline_path = interval_s, resize_timeout_s, timeline_path
        self.clock = clock
        self.timeline: deque[dict[str, Any]] = deque(maxlen=TIMELINE_SAMPLES)
        self._t0 = clock()
        self._task: asyncio.Task | None = None
        self._last_reason: str | None = None
        r = metrics.registry
        self.pool_workers = Gauge("afdserve_autoscale_pool_workers", "Workers in each pool (autoscaling)",
                                  ["pool"], registry=r)
        self.decisions = Counter("afdserve_autoscale_decisions", "Autoscaling decisions (one per sample) by action "
                                 "(up, down, hold), pool and reason", ["action", "pool", "reason"], registry=r)
        self.last_resize = Gauge("afdserve_autoscale_last_resize_timestamp_seconds", "Unix time of the last "
                                 "autoscaling resize decision (0: none yet)", registry=r)
        self.failures = Counter("afdserve_autoscale_resize_failures", "Autoscaling resizes that failed or timed out",
                                registry=r)
        self.signal = Gauge("afdserve_autoscale_signal", "The autoscaler's last sample of each signal (seconds, "
                            "requests, fractions, tokens/s; NaN: none in the interval)", ["signal"], registry=r)
        self._last = (self._t0, self._counters())
        self._show_sizes()

    # ---- lifecycle (on the event loop) ---------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="afdserve-autoscaler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        while not self.engine.closing:
            await asyncio.sleep(self.interval_s)
            if self.engine.closing:
                return
            try:
                await self.step()
            except Exception:  # a turn's bug never ends the loop or the server
                log.exception("autoscaler turn failed")

    # ---- one turn ------------------------------------------------------------------------
    async def step(self) -> Decision:
        """Samples, decides and applies (a resize awaits the engine thread, at most resize_timeout_s)."""
        now = self.clock()
        self._resync()
        sig = self.sample(now)
        d = self.policy.decide(sig, now)
        self._record(d, sig, now)
        if d.action != "hold" and not self.engine.closing and not self.engine.failed:
            self.last_resize.set(time.time())
            target = (d.attention, d.experts)
            try:
                res = await asyncio.wait_for(self.engine.call(lambda eng: eng.scale(*target)), self.resize_timeout_s)
                self.policy.resized(res.attention_workers, res.expert_workers, self.clock())
                log.info("autoscale: now %d attention + %d expert workers (ready in %.1f s)", res.attention_workers,
                         res.expert_workers, res.seconds)
            except Exception as e:  # failed or timed out: the sizes are re-read; a retry after the cool-down
                self.failures.inc()
                self.policy.resize_failed(self.clock())
                log.warning("autoscale: resize to %d attention + %d expert workers failed: %s: %s", *target,
                            type(e).__name__, e)
                try:  # what runs now, read between two steps
                    self._resync(await asyncio.wait_for(self.engine.call(lambda eng: eng.stats().workers),
                                                        self.resize_timeout_s))
                except Exception as e2:
                    log.warning("autoscale: cannot read the pool sizes: %s: %s", type(e2).__name__, e2)
            self._show_sizes()
            self.timeline.append({"t": round(self.clock() - self._t0, 3), "resized": [self.policy.attention,
                                                                                     self.policy.experts]})
            self._write(self.timeline[-1])
        return d

    def _counters(self) -> dict[str, float]:
        get = self.metrics.registry.get_sample_value
        return {k: get(f"afdserve_{k}") or 0.0 for k in ("time_between_tokens_seconds_sum",
                                                          "time_between_tokens_seconds_count",
                                                          "time_to_first_token_seconds_sum",
                                                          "time_to_first_token_seconds_count")}

    def sample(self, now: float) -> Signals:
        """The signals since the last sample (the first: since the autoscaler was made)."""
        s = self.engine.stats()
        cur = self._counters()
        prev_t, prev = self._last
        self._last = (now, cur)
        d = {k: cur[k] - prev[k] for k in cur}
        n_tbt, n_first = d["time_between_tokens_seconds_count"], d["time_to_first_token_seconds_count"]
        att = [v for w, v in s.busy_fraction.items() if w.startswith("attention")]
        exp = [v for w, v in s.busy_fraction.items() if w.startswith("expert")]
        return Signals(
            waiting=s.waiting, running=s.running, kv_usage=max(s.kv_usage.values(), default=0.0),
            tpot_s=d["time_between_tokens_seconds_sum"] / n_tbt if n_tbt > 0 else None,
            ttft_s=d["time_to_first_token_seconds_sum"] / n_first if n_first > 0 else None,
            throughput_tok_s=(n_tbt + n_first) / (now - prev_t) if now > prev_t else 0.0,
            attention_busy=sum(att) / len(att) if att else None, expert_busy=sum(exp) / len(exp) if exp else None)

    # ---- bookkeeping ---------------------------------------------------------------------
    def _resync(self, workers: dict[str, str] | None = None) -> None:
        """The policy's sizes from the deployment's workers (default: the engine loop's latest snapshot):
        a resize that failed or timed out, or one from /admin/scale."""
        workers = self.engine.stats().workers if workers is None else workers
        n_a = sum(w.startswith("attention") for w in workers)
        n_e = sum(w.startswith("expert") for w in workers)
        if n_a and n_e:
            self.policy.attention, self.policy.experts = n_a, n_e

    def _show_sizes(self) -> None:
        self.pool_workers.labels("attention").set(self.policy.attention)
        self.pool_workers.labels("experts").set(self.policy.experts)

    def _record(self, d: Decision, sig: Signals, now: float) -> None:
        self.decisions.labels(d.action, d.pool or "", d.reason).inc()
        for k, v in asdict(sig).items():
            self.signal.labels(k).set(float("nan") if v is None else float(v))
        if d.action != "hold" or d.reason != self._last_reason:
            level = logging.INFO if d.action != "hold" or d.reason != "steady" else logging.DEBUG
            log.log(level, "autoscale %s%s (%s): %s", d.action, f" {d.pool}" if d.pool else "", d.reason, d.detail)
        self._last_reason = d.reason
        entry = {"t": round(now - self._t0, 3), "attention": self.policy.attention, "experts": self.policy.experts,
                 "action": d.action, "pool": d.pool, "reason": d.reason,
                 **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(sig).items()}}
        self.timeline.append(entry)
        self._write(entry)

    def _write(self, entry: dict[str, Any]) -> None:
        if self.timeline_path is None:
            return
        try:
            with open(self.timeline_path, "a") as f:
                f.write(json.dumps(entry) + "\n")
        except OSError as e:  # the timeline is a record, not a reason to stop scaling
            log.warning("autoscale: cannot write the timeline to %s: %s", self.timeline_path, e)
            self.timeline_path = None
