"""Prometheus ``/metrics`` of the scheduler and recorder services (``--metrics-port``).

Theory of operation. Each service keeps plain counters while it works (``Stats`` of the
scheduler, ``StreamStats`` of the recorder, a ``Buckets`` histogram of batch times); nothing in
the batch loop touches a metric library. On a scrape, ``serve_metrics`` awaits ``refresh``
(the consumer lag needs two JetStream look-ups: the stream's last seq, and the time of the first
message not yet applied or recorded) and renders a collector over those counters:

scheduler: ``laswrr_scheduler_events_applied_total``, ``_outputs_published_total``,
``_rejections_total{reason}`` (the rejection's cause code, ``Rejected.cause``: one series per
``schemas.words.RejectCause``, never cut from the reason text),
``_lag_messages`` / ``_lag_seconds`` (LB_EVENTS not yet applied; seconds since the oldest of
them was stored), ``_applied_seq``, ``_checkpoint_age_seconds`` (since the last checkpoint
write or, before one, since start), ``_checkpoint_lag_events``, ``_batch_seconds`` (a batch:
apply, publish, KV, ack).

recorder, per ``stream``: ``laswrr_recorder_rows_written_total``, ``_batches_total``,
``_repaired_total``, ``_gaps_total``, ``_lag_messages`` / ``_lag_seconds``,
``_recorded_seq``, ``_batch_seconds`` (one commit).

Every laswrr ``/metrics`` (these, the collector's and the proxy's) also carries
``laswrr_build_info{version="..."} 1``: ``serve_metrics`` appends ``BUILD_INFO`` to each
scrape, and the proxy registers ``register_build_info`` on its own registry.
"""

from __future__ import annotations

import inspect
import logging
import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterator, Sequence

from aiohttp import web
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from laswrr import __version__

log = logging.getLogger("laswrr.metrics")

BATCH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Buckets:
    """One histogram series: counts per bucket (not cumulative), sum and count."""

    __slots__ = ("bounds", "counts", "total", "count")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: the first bound >= value
        self.total += value
        self.count += 1

    def exposition(self) -> list[tuple[str, float]]:
        cumulative, out = 0, []
        for bound, n in zip([*map(str, self.bounds), "+Inf"], self.counts):
            cumulative += n
            out.append((bound, float(cumulative)))
        return out


async def lag(js: JetStreamContext, stream: str, done_seq: int, now_s: float | None = None) -> tuple[int, float]:
    """(messages of ``stream`` after ``done_seq``, seconds since the first of them was stored)."""
    state = (await js.stream_info(stream)).state
    behind = max(0, state.last_seq - done_seq)
    if behind == 0:
        return 0, 0.0
    try:
        msg = await js.get_msg(stream, max(done_seq + 1, state.first_seq))
    except Exception:  # noqa: BLE001 - deleted meanwhile: the count alone
        return behind, 0.0
    stored = msg.time.timestamp() if msg.time is not None else None
    return behind, 0.0 if stored is None else max(0.0, (now_s or time.time()) - stored)


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def histogram(name: str, doc: str, buckets: Buckets, labels: Sequence[str] = ()) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=list(labels) or None)
    family.add_metric(list(labels), buckets.exposition(), buckets.total)
    return family


class _Families:
    def __init__(self, families: Callable[[], Iterator[Metric]]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return self.families()


def register_build_info(registry: CollectorRegistry) -> None:
    """``laswrr_build_info{version}`` (value 1) on ``registry``."""
    Info("laswrr_build", "The laswrr version of this process", registry=registry).info({"version": __version__})


def _build_info() -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    register_build_info(registry)
    return generate_latest(registry)


BUILD_INFO = _build_info()


def render(families: Callable[[], Iterator[Metric]]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))  # type: ignore[arg-type]
    return generate_latest(registry)


async def serve_metrics(port: int, render_body: Callable[[], bytes | Awaitable[bytes]], host: str = "0.0.0.0",
                        service: str = "laswrr") -> web.AppRunner:
    """Serve ``GET /metrics`` (``render_body()``, awaited if a coroutine, per scrape) on
    ``host:port``; returns the runner to clean up."""

    async def handler(_: web.Request) -> web.Response:
        body = render_body()
        if inspect.isawaitable(body):
            body = await body
        return web.Response(body=body + BUILD_INFO, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("%s metrics on http://%s:%d/metrics", service, host, port)
    return runner
