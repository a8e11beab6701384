"""vLLM-format Prometheus metrics of the simulated engine (one CollectorRegistry per engine).

Imitates vLLM's /metrics (V0 names, V1 buckets; see tests/fixtures/real/METRIC-NAMES.md):
gauges for running/waiting/KV use (new ``kv_cache_usage_perc`` and the old
``gpu_cache_usage_perc`` alias), token and success counters, the prefix-cache counters of vLLM V1
(``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``, in tokens), and the
latency histograms a router would read. All series carry the ``model_name`` label.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from laswrr.services.sim_engine.mindie import Timings
from laswrr.services.sim_engine.physics import EngineSnapshot, SimRequest

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SimMetrics:
    """The metric objects plus the hooks the engine driver calls."""

    def __init__(self, model_name: str, flavour: str = "vllm") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.timings = Timings()  # MindIE's /metrics-json means
        r, labels = self.registry, ["model_name"]
        # MindIE (docs/ascend.md): the same series without the vllm: prefix, KV as npu_cache_usage_perc.
        p = "" if flavour == "mindie" else "vllm:"
        kv_name = "npu_cache_usage_perc" if flavour == "mindie" else "vllm:kv_cache_usage_perc"
        self.running = Gauge(f"{p}num_requests_running", "Number of requests currently running on GPU.", labels, registry=r)
        self.waiting = Gauge(f"{p}num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=r)
        self.kv_usage = Gauge(kv_name, "KV-cache usage. 1 means 100 percent usage.", labels, registry=r)
        self.gpu_cache = Gauge(f"{p}gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", labels, registry=r)
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "Number of prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter(f"{p}generation_tokens", "Number of generation tokens processed.", labels, registry=r)
        self.success = Counter(f"{p}request_success", "Count of successfully processed requests.",
                               ["finished_reason", "model_name"], registry=r)
        self.preemptions = Counter(f"{p}num_preemptions", "Cumulative number of preemption from the engine.", labels, registry=r)
        self.ttft = Histogram(f"{p}time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(f"{p}time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                              labels, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(f"{p}e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                             labels, buckets=REQUEST_BUCKETS, registry=r)
        self.queue = Histogram(f"{p}request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                               labels, buckets=REQUEST_BUCKETS, registry=r)
        self.prefix_queries = Counter(f"{p}prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                      "queried tokens.", labels, registry=r)
        self.prefix_hits = Counter(f"{p}prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                   "tokens.", labels, registry=r)
        self._prefix_seen = (0, 0)
        for metric in (self.prefix_queries, self.prefix_hits, self.running, self.waiting, self.kv_usage, self.gpu_cache, self.prompt_tokens,
                       self.generation_tokens, self.preemptions, self.ttft, self.tpot, self.e2e, self.queue):
            metric.labels(model_name)  # expose every series from the start, as vLLM does

    def on_first_token(self, req: SimRequest) -> None:
        assert req.first_token_at is not None and req.admitted_at is not None
        self.prompt_tokens.labels(self.model_name).inc(req.prompt_tokens)
        self.ttft.labels(self.model_name).observe(req.first_token_at - req.arrival)
        self.queue.labels(self.model_name).observe(max(0.0, req.admitted_at - req.ready_at))

    def on_token(self, gap_s: float | None) -> None:
        self.generation_tokens.labels(self.model_name).inc()
        if gap_s is not None:
            self.tpot.labels(self.model_name).observe(gap_s)

    def on_finished(self, req: SimRequest, finish_reason: str) -> None:
        assert req.finished_at is not None
        ttft = None if req.first_token_at is None else req.first_token_at - req.arrival
        tbt = None if req.first_token_at is None or req.generated < 2 else \
            (req.finished_at - req.first_token_at) / (req.generated - 1)
        self.timings.add(ttft, tbt)
        self.e2e.labels(self.model_name).observe(req.finished_at - req.arrival)
        self.success.labels(finish_reason, self.model_name).inc()

    def render(self, snap: EngineSnapshot) -> bytes:
        self.running.labels(self.model_name).set(snap.running)
        self.waiting.labels(self.model_name).set(snap.waiting)
        self.kv_usage.labels(self.model_name).set(snap.kv_usage)
        self.gpu_cache.labels(self.model_name).set(snap.kv_usage)
        queries, hits = self._prefix_seen
        self.prefix_queries.labels(self.model_name).inc(snap.prefix_cache_queries - queries)
        self.prefix_hits.labels(self.model_name).inc(snap.prefix_cache_hits - hits)
        self._prefix_seen = (snap.prefix_cache_queries, snap.prefix_cache_hits)
        return generate_latest(self.registry)
