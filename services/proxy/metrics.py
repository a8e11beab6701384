"""Prometheus metrics of one proxy replica, on its own registry (no process-global state).

Counters follow the event semantics (one ``requests_total`` sample per attempt, labelled with
the attempt's outcome); gauges that depend on time (snapshot age, event buffer) are refreshed
by ``refresh`` when /metrics is scraped, so the request path never computes them.
Latency histograms: ``ttft`` (arrival at the proxy -> first byte sent to the client),
``duration`` (arrival -> last byte), ``overhead`` (time the proxy itself adds: arrival -> upstream
request sent, plus upstream first byte received -> first byte written to the client).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.proxy.events import EventPublisher
from services.proxy.routing import Router

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ProxyMetrics:
    def __init__(self, proxy_id: str) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("laswrr_proxy_requests", "Attempts by pool, node and outcome",
                                ["pool", "node", "outcome"], registry=registry)
        self.rejected = Counter("laswrr_proxy_rejected", "Requests answered by the proxy itself, by reason",
                                ["reason"], registry=registry)
        self.retries = Counter("laswrr_proxy_retries", "Retries on another node before the first byte",
                               ["pool"], registry=registry)
        self.inflight = Gauge("laswrr_proxy_inflight", "This proxy's live in-flight requests per node",
                              ["node"], registry=registry)
        self.ttft = Histogram("laswrr_proxy_ttft_seconds", "Arrival to first byte sent to the client",
                              ["pool"], buckets=LATENCY_BUCKETS, registry=registry)
        self.duration = Histogram("laswrr_proxy_duration_seconds", "Arrival to last byte sent to the client",
                                  ["pool"], buckets=LATENCY_BUCKETS, registry=registry)
        self.overhead = Histogram("laswrr_proxy_overhead_seconds", "Time added by the proxy itself",
                                  buckets=OVERHEAD_BUCKETS, registry=registry)
        self.snapshot_age = Gauge("laswrr_proxy_snapshot_age_seconds",
                                  "Age of the snapshot in force (now - its event time)", ["pool"], registry=registry)
        self.snapshot_seq = Gauge("laswrr_proxy_snapshot_seq", "as_of_seq of the snapshot in force",
                                  ["pool"], registry=registry)
        self.nats_connected = Gauge("laswrr_proxy_nats_connected", "1 if connected to NATS", registry=registry)
        self.events_dropped = Gauge("laswrr_proxy_events_dropped_total",
                                    "Events dropped because the buffer was full", registry=registry)
        self.events_buffered = Gauge("laswrr_proxy_events_buffered", "Events waiting to be published",
                                     registry=registry)
        self.events_published = Gauge("laswrr_proxy_events_published_total", "Events acknowledged by JetStream",
                                      registry=registry)
        info = Gauge("laswrr_proxy_info", "This replica", ["proxy"], registry=registry)
        info.labels(proxy=proxy_id).set(1)
        self._inflight: dict[str, Any] = {}
        self._requests: dict[tuple[str, str, str], Any] = {}
        self._ttft: dict[str, Any] = {}
        self._duration: dict[str, Any] = {}

    # Label lookups cost microseconds each; the request path uses these cached children.

    def inflight_of(self, node: str) -> Any:
        child = self._inflight.get(node)
        if child is None:
            child = self._inflight[node] = self.inflight.labels(node=node)
        return child

    def count_request(self, pool: str, node: str, outcome: str) -> None:
        key = (pool, node, outcome)
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self.requests.labels(pool=pool, node=node, outcome=outcome)
        child.inc()

    def observe_latency(self, pool: str, ttft_s: float | None, duration_s: float, overhead_s: float | None) -> None:
        if ttft_s is not None:
            child = self._ttft.get(pool) or self._ttft.setdefault(pool, self.ttft.labels(pool=pool))
            child.observe(ttft_s)
        if overhead_s is not None:
            self.overhead.observe(overhead_s)
        child = self._duration.get(pool) or self._duration.setdefault(pool, self.duration.labels(pool=pool))
        child.observe(duration_s)

    def refresh(self, router: Router, publisher: EventPublisher, nats_connected: bool) -> None:
        now_ns = time.time_ns()
        for pool, route in router.pools.items():
            self.snapshot_age.labels(pool=pool).set(max(0.0, (now_ns - route.snapshot.ts_ns) / 1e9))
            self.snapshot_seq.labels(pool=pool).set(route.snapshot.as_of_seq)
        self.nats_connected.set(1 if nats_connected else 0)
        self.events_dropped.set(publisher.dropped)
        self.events_buffered.set(publisher.buffered)
        self.events_published.set(publisher.published)

    def render(self) -> bytes:
        return generate_latest(self.registry)
