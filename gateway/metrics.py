"""Prometheus metrics: the gateway's own counters and latency histograms, plus the scheduler's snapshot.

Queue time is measured from the moment a request enters the bus to its first token, so it includes
the first prefill step: the bus carries no scheduling timestamp back to the gateway. Requests' counters and
histograms carry a `tenant` label: the keys file's tenants (at most shared/tenants.py's MAX_TENANTS), or
`default`.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shared.protocol import SchedulerStats, TenantStats, WorkerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FAST_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SLOW_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class SchedulerCollector:
    """Exports the last SchedulerStats read from Redis; absent until a scheduler has written one."""

    def __init__(self) -> None:
        self.stats: SchedulerStats | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        for name, value, doc in (("num_requests_running", s.running, "requests with sequences running"),
                                 ("num_requests_waiting", s.waiting, "requests waiting to be scheduled"),
                                 ("num_requests_preempted", s.preempted, "requests preempted, waiting to resume")):
            yield GaugeMetricFamily(f"pagedserve_{name}", doc, value=value)
        yield CounterMetricFamily("pagedserve_num_preemptions", "preemptions since the scheduler started",
                                  value=s.preemptions)
        yield GaugeMetricFamily("pagedserve_scheduler_stats_age_seconds", "age of the scheduler's snapshot",
                                value=max(time.time() - s.time, 0.0))
        for name, family, doc, value in PER_WORKER:
            metric = family(name, doc, labels=["worker"])
            for w in s.workers:
                metric.add_metric([w.worker_id], value(w))
            yield metric
        per_position = CounterMetricFamily("pagedserve_spec_decode_num_accepted_tokens_per_pos", "proposed tokens "
                                           "accepted, by their place in the draft (0 first)",
                                           labels=["worker", "position"])
        for w in s.workers:
            for position, count in enumerate(w.accepted_at):
                per_position.add_metric([w.worker_id, str(position)], count)
        yield per_position
        for name, doc, value in PER_TENANT:
            metric = GaugeMetricFamily(name, doc, labels=["tenant"])
            for t in s.tenants:
                metric.add_metric([t.tenant], value(t))
            yield metric


class BusCollector:
    """The Redis failovers (Sentinel moving the master) that this gateway's client followed, and the waits for the
    master's replicas that ended without them (gateway/replication.py)."""

    def __init__(self) -> None:
        self.failovers = 0
        self.replica_shortfalls = 0

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("pagedserve_redis_failovers", "Redis master moves (Sentinel failovers) this "
                                  "gateway's client followed", value=self.failovers)
        yield CounterMetricFamily("pagedserve_redis_replica_shortfalls", "waits for the Redis replicas that timed "
                                  "out, after which clients were shown what the replicas may not hold",
                                  value=self.replica_shortfalls)


# Per worker, from the scheduler's snapshot: (name, family, help, value).
PER_WORKER: list[tuple[str, type, str, Callable[[WorkerStats], float]]] = [
    ("pagedserve_kv_cache_usage_perc", GaugeMetricFamily, "share of KV blocks in use (0-1)",
     lambda w: (w.num_blocks - w.free_blocks) / w.num_blocks if w.num_blocks else 0.0),
    ("pagedserve_kv_cache_blocks", GaugeMetricFamily, "KV blocks of the worker", lambda w: w.num_blocks),
    ("pagedserve_kv_cache_shared_blocks", GaugeMetricFamily, "KV blocks held by more than one sequence (prefix "
     "hits, parallel samples, beams)", lambda w: w.shared_blocks),
    ("pagedserve_worker_running_sequences", GaugeMetricFamily, "sequences running on the worker", lambda w: w.running),
    ("pagedserve_prefix_cache_queries", CounterMetricFamily, "prompt tokens looked up in the prefix cache",
     lambda w: w.prefix_queries),
    ("pagedserve_prefix_cache_hits", CounterMetricFamily, "prompt tokens found in the prefix cache",
     lambda w: w.prefix_hits),
    ("pagedserve_worker_steps", CounterMetricFamily, "step plans sent to the worker", lambda w: w.steps),
    ("pagedserve_worker_plan_wait_seconds", CounterMetricFamily, "seconds the worker, holding sequences, waited for "
     "its next plan: its rate is the share of the worker the scheduler leaves idle", lambda w: w.plan_wait),
    ("pagedserve_sequence_forks", CounterMetricFamily, "sequences forked from another on shared blocks "
     "(parallel samples, beams)", lambda w: w.forks),
    ("pagedserve_kv_block_copies", CounterMetricFamily, "copy-on-write block copies", lambda w: w.copies),
    # speculative decoding, as vLLM names it (spec_decode_*); the rate and mean length since start
    ("pagedserve_spec_decode_num_drafts", CounterMetricFamily, "speculative drafts checked", lambda w: w.drafts),
    ("pagedserve_spec_decode_num_draft_tokens", CounterMetricFamily, "tokens the drafts proposed",
     lambda w: w.draft_tokens),
    ("pagedserve_spec_decode_num_accepted_tokens", CounterMetricFamily, "proposed tokens accepted",
     lambda w: w.accepted_tokens),
    ("pagedserve_spec_decode_acceptance_rate", GaugeMetricFamily, "accepted tokens over proposed tokens (0-1)",
     lambda w: w.accepted_tokens / w.draft_tokens if w.draft_tokens else 0.0),
    ("pagedserve_spec_decode_mean_acceptance_length", GaugeMetricFamily, "tokens a drafting step gives on average: "
     "1 + accepted tokens per draft", lambda w: 1.0 + w.accepted_tokens / w.drafts if w.drafts else 0.0),
]


# Per tenant, across the cluster, from the scheduler's snapshot: (name, help, value).
PER_TENANT: list[tuple[str, str, Callable[[TenantStats], float]]] = [
    ("pagedserve_tenant_waiting_requests", "requests of the tenant not admitted yet", lambda t: t.waiting),
    ("pagedserve_tenant_running_sequences", "sequences of the tenant running", lambda t: t.running_seqs),
    ("pagedserve_tenant_tokens_last_minute", "prompt and generated tokens computed for the tenant in the last "
     "minute: its share of the capacity", lambda t: t.tokens_last_minute),
]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        tenant = ["tenant"]
        self.prompt_tokens = Counter("pagedserve_prompt_tokens", "prompt tokens submitted", tenant, registry=r)
        self.generation_tokens = Counter("pagedserve_generation_tokens", "tokens generated and received", tenant,
                                         registry=r)
        self.finished = Counter("pagedserve_request_finished", "choices ended, by finish reason",
                                ["finish_reason", "tenant"], registry=r)
        self.ttft = Histogram("pagedserve_time_to_first_token_seconds", "HTTP request received to first token",
                              tenant, buckets=FAST_BUCKETS, registry=r)
        self.tpot = Histogram("pagedserve_time_per_output_token_seconds", "mean gap between a request's tokens "
                              "after the first", tenant, buckets=FAST_BUCKETS, registry=r)
        self.e2e = Histogram("pagedserve_e2e_request_latency_seconds", "HTTP request received to last token",
                             tenant, buckets=SLOW_BUCKETS, registry=r)
        self.queue = Histogram("pagedserve_request_queue_time_seconds", "request entering the bus to its "
                               "first token", tenant, buckets=SLOW_BUCKETS, registry=r)
        self.waiting = Gauge("pagedserve_gateway_waiting_requests", "requests of this gateway without a first "
                             "token yet", registry=r)
        self.workers_alive = Gauge("pagedserve_workers_alive", "workers with a fresh heartbeat", registry=r)
        self.scheduler = SchedulerCollector()
        r.register(self.scheduler)
        self.bus = BusCollector()
        r.register(self.bus)

    def render(self, stats: SchedulerStats | None, workers_alive: int, gateway_waiting: int,
               redis_failovers: int, replica_shortfalls: int) -> bytes:
        self.scheduler.stats = stats
        self.bus.failovers = redis_failovers
        self.bus.replica_shortfalls = replica_shortfalls
        self.workers_alive.set(workers_alive)
        self.waiting.set(gateway_waiting)
        return generate_latest(self.registry)
