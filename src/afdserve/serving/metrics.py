"""The server's Prometheus metrics (``GET /metrics``).

Request metrics are recorded as requests progress (the ``Observer`` of ``AsyncEngine`` and the
HTTP status middleware); deployment metrics are read from the engine thread's latest
``EngineStats`` snapshot at scrape time (with each worker's state, restarts and last failure), the
engine loop's heartbeat age, the recent expert load (tokens per expert per step,
imbalance per layer) by ``afdserve.balance.metrics.ExpertLoadCollector``. Each server has its own
registry.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from afdserve.balance.metrics import ExpertLoadCollector
from afdserve.engine.stats import EngineStats

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
MICRO_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


WORKER_STATES = ("up", "down", "restarting", "starting")


class _Snapshot(Collector):
    def __init__(self, stats: Callable[[], EngineStats], in_flight: Callable[[], int],
                 heartbeat_age: Callable[[], float] | None = None):
        self.stats, self.in_flight, self.heartbeat_age = stats, in_flight, heartbeat_age

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.stats()
        if self.heartbeat_age is not None:
            age = self.heartbeat_age()
            yield GaugeMetricFamily("afdserve_engine_heartbeat_age_seconds", "Seconds since the engine loop last "
                                    "turned (+Inf once it stopped)", value=age)
        yield from _workers(s)
        yield from _prefix_cache(s)
        yield GaugeMetricFamily("afdserve_num_requests_running", "Requests in the running batch", value=s.running)
        yield GaugeMetricFamily("afdserve_num_requests_waiting", "Requests waiting to be scheduled", value=s.waiting)
        yield GaugeMetricFamily("afdserve_num_requests_in_flight", "Requests (prompts) accepted and not finished",
                                value=self.in_flight())
        kv = GaugeMetricFamily("afdserve_kv_cache_usage_ratio", "Used fraction of the KV-cache blocks",
                               labels=["worker"])
        for w, v in sorted(s.kv_usage.items()):
            kv.add_metric([w], v)
        yield kv
        tok = CounterMetricFamily("afdserve_expert_tokens", "Tokens routed to each expert", labels=["layer", "expert"])
        for layer, row in enumerate(s.expert_tokens):
            for e, n in enumerate(row):
                tok.add_metric([str(layer), str(e)], n)
        yield tok
        ew = CounterMetricFamily("afdserve_expert_worker_tokens", "Tokens sent to each expert worker (all layers)",
                                 labels=["worker"])
        for w, n in sorted(s.expert_worker_tokens.items()):
            ew.add_metric([w], n)
        yield ew
        bs = CounterMetricFamily("afdserve_worker_busy_seconds", "Busy seconds of each worker (colocated engine: "
                                 "step time; worker processes: CPU time per torch thread)", labels=["worker"])
        for w, v in sorted(s.busy_seconds.items()):
            bs.add_metric([w], v)
        yield bs
        bf = GaugeMetricFamily("afdserve_worker_busy_ratio", "Busy fraction of each worker over the last stats "
                               "interval", labels=["worker"])
        for w, v in sorted(s.busy_fraction.items()):
            bf.add_metric([w], v)
        yield bf


def _workers(s: EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Each worker's state, restarts and last failure (none for the colocated engine)."""
    up = GaugeMetricFamily("afdserve_worker_up", "1 while the worker is up, else 0 (down or restarting)",
                           labels=["worker"])
    state = GaugeMetricFamily("afdserve_worker_state", "1 for the worker's current state (up, down, restarting)",
                              labels=["worker", "state"])
    for w, st in sorted(s.workers.items()):
        up.add_metric([w], 1.0 if st == "up" else 0.0)
        for known in sorted(set(WORKER_STATES) | {st}):
            state.add_metric([w, known], 1.0 if known == st else 0.0)
    restarts = CounterMetricFamily("afdserve_worker_restarts", "Times the worker was restarted", labels=["worker"])
    for w in sorted(set(s.workers) | set(s.restarts)):
        restarts.add_metric([w], s.restarts.get(w, 0))
    failure = GaugeMetricFamily("afdserve_worker_last_failure_info", "The cause of the worker's last failure "
                                "(value 1)", labels=["worker", "cause"])
    for w, cause in sorted(s.last_failure.items()):
        failure.add_metric([w, cause if len(cause) <= 200 else cause[:197] + "..."], 1.0)
    dropped = CounterMetricFamily("afdserve_dropped_expert_assignments", "(token, k) expert assignments dropped "
                                  "while an expert worker was missing (--on-expert-loss=drop: top-(K-1) routing)")
    dropped.add_metric([], s.dropped_expert_assignments)
    over = CounterMetricFamily("afdserve_expert_capacity_dropped_assignments", "(token, k) expert assignments "
                               "dropped over an expert worker's capacity (--on-expert-overflow=drop)")
    over.add_metric([], s.capacity_dropped_assignments)
    second = CounterMetricFamily("afdserve_expert_second_pass_rows", "Token rows sent to expert workers in a "
                                 "second round, over their capacity (--on-expert-overflow=second-pass)")
    second.add_metric([], s.second_pass_rows)
    yield from (up, state, restarts, failure, dropped, over, second)


def _prefix_cache(s: EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Each worker's prefix cache (colocated: the engine; a cluster: each attention worker), as of
    the last stats refresh: hits, tokens served from each tier, restores versus recomputes, evictions, use."""
    caches = sorted((w, c) for w, c in s.prefix_cache.items() if c.enabled)
    rate = GaugeMetricFamily("afdserve_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt "
                             "tokens looked up, since start", labels=["worker"])
    queries = CounterMetricFamily("afdserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  labels=["worker"])
    hits = CounterMetricFamily("afdserve_prefix_cache_hits", "Prompt tokens served from the prefix cache",
                               labels=["worker"])
    requests = CounterMetricFamily("afdserve_prefix_cache_requests", "Admissions that looked the prefix cache up "
                                   "(hit: with at least one cached block)", labels=["worker", "result"])
    tiers = CounterMetricFamily("afdserve_prefix_cache_tier_hit_tokens", "Prompt tokens served from each tier "
                                "(device: in the KV cache; host, disk: restored)", labels=["worker", "tier"])
    blocks = CounterMetricFamily("afdserve_prefix_cache_host_disk_blocks", "Blocks found in host memory or on disk: "
                                 "restored, or recomputed because that was cheaper", labels=["worker", "action"])
    evict = CounterMetricFamily("afdserve_prefix_cache_evictions", "Blocks evicted from each tier",
                                labels=["worker", "tier"])
    invalid = CounterMetricFamily("afdserve_prefix_cache_invalid_disk_files", "Disk-tier files ignored (truncated, "
                                  "corrupt, or of another model or dtype)", labels=["worker"])
    used = GaugeMetricFamily("afdserve_prefix_cache_usage", "Use of each tier (device: cached blocks; host, disk: "
                             "bytes)", labels=["worker", "tier"])
    limit = GaugeMetricFamily("afdserve_prefix_cache_limit", "Bound of each tier (device: blocks; host, disk: "
                              "bytes)", labels=["worker", "tier"])
    for w, c in caches:
        rate.add_metric([w], c.hit_rate)
        queries.add_metric([w], c.query_tokens)
        hits.add_metric([w], c.hit_tokens)
        requests.add_metric([w, "hit"], c.hit_requests)
        requests.add_metric([w, "miss"], c.query_requests - c.hit_requests)
        for tier, n in (("device", c.device_hit_tokens), ("host", c.host_hit_tokens), ("disk", c.disk_hit_tokens)):
            tiers.add_metric([w, tier], n)
        blocks.add_metric([w, "restored"], c.restored_blocks)
        blocks.add_metric([w, "recomputed"], c.recomputed_blocks)
        for tier, n in (("device", c.device_evictions), ("host", c.host_evictions), ("disk", c.disk_evictions)):
            evict.add_metric([w, tier], n)
        invalid.add_metric([w], c.invalid_disk_files)
        for tier, u, bound in (("device", c.device_cached_blocks, c.device_total_blocks),
                               ("host", c.host_bytes, c.host_bytes_limit), ("disk", c.disk_bytes, c.disk_bytes_limit)):
            used.add_metric([w, tier], u)
            limit.add_metric([w, tier], bound)
    yield from (rate, queries, hits, requests, tiers, blocks, evict, invalid, used, limit)


class ServingMetrics:
    """Implements ``async_engine.Observer``; ``render`` is the Prometheus text exposition."""

    def __init__(self, stats: Callable[[], EngineStats], in_flight: Callable[[], int],
                 heartbeat_age: Callable[[], float] | None = None):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("afdserve_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finish = Counter("afdserve_request_finish", "Generations (one per prompt) ended, by reason "
                              "(stop, length, abort, error)", ["reason"], registry=r)
        self.ttft = Histogram("afdserve_time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tbt = Histogram("afdserve_time_between_tokens_seconds", "Time between consecutive output tokens",
                             buckets=TBT_BUCKETS, registry=r)
        self.e2e = Histogram("afdserve_e2e_request_latency_seconds", "Time from arrival to the last token of "
                             "generations that finished (stop or length)", buckets=E2E_BUCKETS, registry=r)
        self.micro_batch = Histogram("afdserve_micro_batch_tokens", "Tokens per micro-batch of each step",
                                     buckets=MICRO_BATCH_BUCKETS, registry=r)
        r.register(_Snapshot(stats, in_flight, heartbeat_age))
        r.register(ExpertLoadCollector(lambda: stats().expert_load))  # the recent window, per step

    # ---- Observer -----------------------------------------------------------------------
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def between_tokens(self, seconds: float, count: int) -> None:
        for _ in range(count):
            self.tbt.observe(seconds / count)

    def finished(self, reason: str, seconds: float) -> None:
        self.finish.labels(reason).inc()
        if reason in ("stop", "length"):
            self.e2e.observe(seconds)

    def micro_batches(self, sizes: list[int]) -> None:
        for n in sizes:
            self.micro_batch.observe(n)

    # ---- HTTP ---------------------------------------------------------------------------
    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
