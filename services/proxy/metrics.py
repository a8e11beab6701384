"""Prometheus metrics of one proxy replica, on its own registry (no process-global state).

Counters follow the event semantics (one ``requests_total`` sample per attempt, labelled with
the attempt's outcome); gauges that depend on time (snapshot age, event buffer) are refreshed
by ``refresh`` when /metrics is scraped, so the request path never computes them.
Latency histograms: ``ttft`` (arrival at the proxy -> first byte of a streamed answer sent to
the client; a whole answer's first byte is its end, so non-streamed requests are not in it),
``duration`` (arrival -> last byte), ``overhead`` (time the proxy itself adds: arrival -> upstream
request sent, plus upstream first byte received -> first byte written to the client).

The per-request series (requests, responses by status code, the three histograms)
are plain ints and lists updated in the request path (no label lookup, no lock: the proxy is one
event loop) and turned into metric families by ``_RequestCollector`` only when /metrics is
scraped. So are the routing decisions of the snapshots in force, per ``{pool, node}``:
``laswrr_node_effective_weight``, ``laswrr_node_target_weight``, ``laswrr_node_routable`` (0/1),
``laswrr_node_phase{phase}`` (1 for the current phase, 0 for the others) and
``laswrr_node_inflight`` (this proxy's own live count, the router's), ``laswrr_node_inflight_estimate``
(the pool-wide estimate the pick uses: the other replicas' requests as of the snapshot plus this
proxy's own, scheduler/routing/load.py), and the event publisher's counters
(``laswrr_proxy_events_published_total``, ``laswrr_proxy_events_dropped_total``,
``laswrr_proxy_event_batches_published_total``, ``laswrr_proxy_event_batches_resent_total``) and its
batch sizes (the histogram ``laswrr_proxy_event_batch_size``: events per acknowledged
``lb.req.batch`` message).
``laswrr_proxy_events_published_bytes_total`` counts those batches' bytes (payloads and
subjects), and ``laswrr_proxy_peer_messages_total{kind}`` (``whole``, ``changes``) and
``laswrr_proxy_peer_bytes_total`` what this proxy sent on the channel between proxies: the
channel's share of the bus against the request events'.
``laswrr_proxy_view_lag_seconds`` is a histogram of how old each snapshot was (wall clock minus
its event time) when this proxy installed it: the staleness of the other replicas' counts at
the first pick on it (they age by one tick more until the next snapshot).
``laswrr_proxy_peer_lag_seconds`` is the same for each message from another proxy on the channel
(wall clock minus its sender's time when this proxy took it): the bus's delivery time, plus the
skew between the two hosts' clocks when they differ.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from laswrr.scheduler.phases import Phase
from laswrr.services.proxy.events import EventPublisher
from laswrr.services.proxy.keys import ApiKeys
from laswrr.services.service_metrics import Buckets, register_build_info
from laswrr.scheduler.routing.latency import pool_signals
from laswrr.scheduler.routing.router import Router

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
CONTENT_TYPE = CONTENT_TYPE_LATEST


def status_class(status: int | None) -> str:
    """``"2xx"`` ... ``"5xx"`` for an HTTP status, ``"none"`` for no answer (the views' ``status_class``)."""
    return "none" if status is None else f"{status // 100}xx"


class _RequestCollector(Collector):
    def __init__(self, metrics: "ProxyMetrics") -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.m
        requests = CounterMetricFamily("laswrr_proxy_requests", "Attempts by pool, node and outcome",
                                       labels=["pool", "node", "outcome"])
        for key, n in sorted(m.requests.items()):
            requests.add_metric(list(key), n)
        yield requests
        for name, doc, series in (("laswrr_proxy_ttft_seconds", "Arrival to first byte of a streamed answer sent to "
                                   "the client", m.ttft),
                                  ("laswrr_proxy_duration_seconds", "Arrival to last byte sent to the client",
                                   m.duration)):
            family = HistogramMetricFamily(name, doc, labels=["pool"])
            for pool, buckets in sorted(series.items()):
                family.add_metric([pool], buckets.exposition(), buckets.total)
            yield family
        overhead = HistogramMetricFamily("laswrr_proxy_overhead_seconds", "Time added by the proxy itself")
        overhead.add_metric([], m.overhead.exposition(), m.overhead.total)
        yield overhead
        responses = CounterMetricFamily("laswrr_proxy_responses", "Responses sent to clients by HTTP status code",
                                        labels=["code"])
        for code, n in sorted(m.responses.items()):
            responses.add_metric([str(code)], n)
        yield responses
        answers = CounterMetricFamily(
            "laswrr_proxy_answers", "Answers by who gave them (engine: each attempt's status; router: the proxy's own "
            "refusals, lb.req.refused) and status class (2xx, 3xx, 4xx, 5xx; none: the engine never answered)",
            labels=["by", "class"])
        for (by, klass), n in sorted(m.answers.items()):
            answers.add_metric([by, klass], n)
        yield answers
        if m.publisher is not None:
            yield CounterMetricFamily("laswrr_proxy_events_published", "Events acknowledged by JetStream",
                                      value=m.publisher.published)
            yield CounterMetricFamily("laswrr_proxy_events_published_bytes",
                                      "Bytes of the acknowledged event batches (payloads and subjects)",
                                      value=m.publisher.published_bytes)
            yield CounterMetricFamily("laswrr_proxy_events_dropped", "Events dropped because the buffer was full",
                                      value=m.publisher.dropped)
            yield CounterMetricFamily("laswrr_proxy_event_batches_published",
                                      "Batches of events (lb.req.batch) acknowledged by JetStream",
                                      value=m.publisher.batches_published)
            yield CounterMetricFamily("laswrr_proxy_event_batches_resent",
                                      "Batches published again under the same Nats-Msg-Id (an ack lost or late)",
                                      value=m.publisher.resent)
            sizes = HistogramMetricFamily("laswrr_proxy_event_batch_size", "Events per acknowledged batch")
            sizes.add_metric([], m.publisher.batch_sizes.exposition(), m.publisher.batch_sizes.total)
            yield sizes
        if m.router is not None:
            yield from _routing_families(m.router)
        if m.peers is not None:
            messages = CounterMetricFamily("laswrr_proxy_peer_messages", "Messages this proxy sent on the "
                                           "channel between proxies (lb.peer), by kind: whole views or changes",
                                           labels=["kind"])
            messages.add_metric(["whole"], m.peers.peer_sent_whole)
            messages.add_metric(["changes"], m.peers.peer_sent - m.peers.peer_sent_whole)
            yield messages
            yield CounterMetricFamily("laswrr_proxy_peer_bytes", "Bytes this proxy sent on the channel between "
                                      "proxies (payloads and subjects)", value=m.peers.peer_sent_bytes)
            lag = HistogramMetricFamily("laswrr_proxy_peer_lag_seconds", "Age of each message from another proxy "
                                        "(now - its sender's time) when taken")
            lag.add_metric([], m.peers.peer_lag.exposition(), m.peers.peer_lag.total)
            yield lag
        if m.view_lag is not None:
            lag = HistogramMetricFamily("laswrr_proxy_view_lag_seconds",
                                        "Age of each snapshot (now - its event time) when installed")
            lag.add_metric([], m.view_lag.exposition(), m.view_lag.total)
            yield lag
        if m.keys is not None:  # names only, never a key (services/proxy/keys.py)
            per_key = CounterMetricFamily("laswrr_proxy_api_key_requests", "Requests admitted per API key name",
                                          labels=["key"])
            inflight = GaugeMetricFamily("laswrr_proxy_api_key_inflight", "Requests in flight per API key name",
                                         labels=["key"])
            for name, _ in m.keys.entries:
                per_key.add_metric([name], m.keys.requests.get(name, 0))
                inflight.add_metric([name], m.keys.inflight.get(name, 0))
            yield from (per_key, inflight)


PHASES = tuple(phase.value for phase in Phase)


class PeerCounts(Protocol):
    """What the channel between proxies counts (``services.proxy.bus.BusLink``)."""

    peer_sent: int
    peer_sent_whole: int
    peer_sent_bytes: int
    peer_lag: Buckets


def _routing_families(router: Router) -> Iterator[Metric]:
    """The routing decisions of the snapshots this proxy holds (module doc)."""
    labels = ["pool", "node"]
    effective = GaugeMetricFamily("laswrr_node_effective_weight", "Effective weight in the snapshot in force", labels=labels)
    target = GaugeMetricFamily("laswrr_node_target_weight", "Target weight in the snapshot in force", labels=labels)
    routable = GaugeMetricFamily("laswrr_node_routable", "1 if the snapshot in force lets the node take requests",
                                 labels=labels)
    phase = GaugeMetricFamily("laswrr_node_phase", "1 for the node's phase in the snapshot in force",
                              labels=[*labels, "phase"])
    inflight = GaugeMetricFamily("laswrr_node_inflight", "This proxy's live in-flight requests on the node",
                                 labels=labels)
    estimate = GaugeMetricFamily("laswrr_node_inflight_estimate", "Pool-wide in-flight estimate the pick uses: "
                                 "other replicas' as of the snapshot plus this proxy's own", labels=labels)
    load = router.table.load
    for pool, snapshot in sorted(router.table.snapshots().items()):
        for view in snapshot.nodes:
            key = [pool, view.node]
            effective.add_metric(key, view.effective_weight)
            target.add_metric(key, view.target_weight)
            routable.add_metric(key, 1.0 if view.routable else 0.0)
            inflight.add_metric(key, load.own_of(view.node))
            estimate.add_metric(key, load.estimate_of(view.node))
            for name in PHASES:
                phase.add_metric([*key, name], 1.0 if view.phase == name else 0.0)
    yield from (effective, target, routable, phase, inflight, estimate)
    yield from _pool_families(router)
    yield from _kv_families(router)


def _kv_families(router: Router) -> Iterator[Metric]:
    """The exact cache view (``--tokenizer``): per node whose engine's KV events reached this
    proxy, whether its view is exact (1) or stale since a lost change (0: the node is routed on
    the estimated view), and the blocks it holds."""
    kv = router.table.kv
    if not kv.nodes:
        return
    exact = GaugeMetricFamily("laswrr_proxy_kv_view_exact", "1: the node's KV cache view is exact (its "
                              "engine's events); 0: stale since a lost change, routed on the estimated view",
                              labels=["node"])
    blocks = GaugeMetricFamily("laswrr_proxy_kv_view_blocks", "KV blocks the node's engine holds, by its events",
                               labels=["node"])
    pending = GaugeMetricFamily("laswrr_proxy_kv_view_in_flight_blocks", "KV blocks of this proxy's requests in "
                                "flight on the node, counted as held until they end (--kv-in-flight)",
                                labels=["node"])
    for node, held in sorted(kv.nodes.items()):
        exact.add_metric([node], 1 if kv.exact(node) else 0)
        blocks.add_metric([node], len(held.keys))
        pending.add_metric([node], len(held.pending))
    yield from (exact, blocks, pending)


def _pool_families(router: Router) -> Iterator[Metric]:
    """Per pool, what an autoscaler reads (``scheduler.routing.latency.pool_signals``; docs/autoscaling.md)."""
    saturation = GaugeMetricFamily("laswrr_pool_saturation", "In flight over the routable nodes' slot limits "
                                   "(concurrency_limit, else capacity), pool-wide estimate", labels=["pool"])
    backlog = GaugeMetricFamily("laswrr_pool_token_backlog_seconds", "Prefill backlog in seconds of the pool's "
                                "measured prefill throughput", labels=["pool"])
    ttft = GaugeMetricFamily("laswrr_pool_predicted_ttft_seconds", "Soonest predicted first token of a short "
                             "request in the pool (the latency estimate)", labels=["pool"])
    load, model = router.table.load, router.admitter.latency
    work = load.work_backlog()
    for pool, route in sorted(router.table.routes()):
        slots = [(node, view.concurrency_limit or view.capacity) for node, view in route.first.targets.items()]
        signals = pool_signals(slots, load.load, work, model)
        saturation.add_metric([pool], signals.saturation)
        if signals.backlog_s is not None:
            backlog.add_metric([pool], signals.backlog_s)
        if signals.predicted_ttft_s is not None:
            ttft.add_metric([pool], signals.predicted_ttft_s)
    yield from (saturation, backlog, ttft)


class ProxyMetrics:
    def __init__(self, proxy_id: str, keys: ApiKeys | None = None) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        register_build_info(registry)
        self.keys = keys
        self.requests: dict[tuple[str, str, str], int] = {}
        self.ttft: dict[str, Buckets] = {}
        self.duration: dict[str, Buckets] = {}
        self.overhead = Buckets(OVERHEAD_BUCKETS)
        self.responses: dict[int, int] = {}
        self.answers: dict[tuple[str, str], int] = {}  # (by, status class) -> count
        self.router: Router | None = None  # set by refresh, read when /metrics is rendered
        self.publisher: EventPublisher | None = None
        self.view_lag: Buckets | None = None
        self.peers: PeerCounts | None = None  # the channel between proxies' counters (the bus link)
        registry.register(_RequestCollector(self))
        self.rejected = Counter("laswrr_proxy_rejected", "Requests answered by the proxy itself, by reason",
                                ["reason"], registry=registry)
        self.retries = Counter("laswrr_proxy_retries", "Retries on another node before the first byte",
                               ["pool"], registry=registry)
        self.continuations = Counter("laswrr_proxy_continuations", "Broken streams continued on another node",
                                     ["pool"], registry=registry)
        self.snapshot_age = Gauge("laswrr_proxy_snapshot_age_seconds",
                                  "Age of the snapshot in force (now - its event time)", ["pool"], registry=registry)
        self.snapshot_seq = Gauge("laswrr_proxy_snapshot_seq", "as_of_seq of the snapshot in force",
                                  ["pool"], registry=registry)
        self.nats_connected = Gauge("laswrr_proxy_nats_connected", "1 if connected to NATS", registry=registry)
        self.events_buffered = Gauge("laswrr_proxy_events_buffered", "Events waiting to be published",
                                     registry=registry)
        info = Gauge("laswrr_proxy_info", "This replica", ["proxy"], registry=registry)
        info.labels(proxy=proxy_id).set(1)

    # The request path: plain dict and list updates.

    def count_response(self, status: int) -> None:
        self.responses[status] = self.responses.get(status, 0) + 1

    def count_request(self, pool: str, node: str, outcome: str, status: int | None = None) -> None:
        key = (pool, node, outcome)
        self.requests[key] = self.requests.get(key, 0) + 1
        answer = ("engine", status_class(status))
        self.answers[answer] = self.answers.get(answer, 0) + 1

    def count_refusal(self, cause: str, status: int) -> None:
        """The proxy answered a request itself (``lb.req.refused``)."""
        self.rejected.labels(reason=cause).inc()
        answer = ("router", status_class(status))
        self.answers[answer] = self.answers.get(answer, 0) + 1

    def observe_latency(self, pool: str, ttft_s: float | None, duration_s: float, overhead_s: float | None) -> None:
        if ttft_s is not None:
            series = self.ttft.get(pool)
            if series is None:
                series = self.ttft[pool] = Buckets(LATENCY_BUCKETS)
            series.observe(ttft_s)
        if overhead_s is not None:
            self.overhead.observe(overhead_s)
        series = self.duration.get(pool)
        if series is None:
            series = self.duration[pool] = Buckets(LATENCY_BUCKETS)
        series.observe(duration_s)

    def refresh(self, router: Router, publisher: EventPublisher, nats_connected: bool,
                view_lag: Buckets | None = None, peers: PeerCounts | None = None) -> None:
        now_ns = time.time_ns()
        for pool, snapshot in router.table.snapshots().items():
            self.snapshot_age.labels(pool=pool).set(max(0.0, (now_ns - snapshot.ts_ns) / 1e9))
            self.snapshot_seq.labels(pool=pool).set(snapshot.as_of_seq)
        self.nats_connected.set(1 if nats_connected else 0)
        self.events_buffered.set(publisher.buffered)
        self.router, self.publisher, self.view_lag, self.peers = router, publisher, view_lag, peers

    def render(self) -> bytes:
        return generate_latest(self.registry)
