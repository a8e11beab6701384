"""Pure parser for an inference engine's Prometheus ``/metrics`` text.

Rules
-----
* Pure functions of ``str``: no I/O, clock, randomness or logging here; the scraper lives
  elsewhere. Parsing is done by ``prometheus_client.parser.text_string_to_metric_families``;
  this module only picks and aggregates series.
* Every malformed input raises ``collectors.errors.ParseError`` (one line), never another
  exception type.

Names (tests/fixtures/real/METRIC-NAMES.md)
-------------------------------------------
* vLLM (V0, V1 and vLLM-Ascend, which keeps upstream names): ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, KV ``vllm:kv_cache_usage_perc`` (>= 0.9) preferred over the
  older/deprecated alias ``vllm:gpu_cache_usage_perc``; histograms
  ``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds``.
* SGLang: ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, KV = ``sglang:token_usage``,
  same histogram names with the ``sglang:`` prefix.
* Prefix cache, where the engine has it: vLLM V1's counters ``vllm:prefix_cache_queries_total``
  and ``vllm:prefix_cache_hits_total`` (tokens, summed over series), SGLang's gauge
  ``sglang:cache_hit_rate`` (a fraction, the mean over series). MindIE exposes neither.
* MindIE: no prefix: ``num_requests_running``, ``num_requests_waiting``,
  ``npu_cache_usage_perc``, ``time_to_first_token_seconds`` (exposed WITHOUT ``_sum``),
  ``e2e_request_latency_seconds``.

Aggregation
-----------
* Counts (running, waiting) and histogram ``_sum``/``_count``/buckets are SUMMED over the
  series that remain (vLLM V1 has one series per ``engine`` label = DP rank).
* KV usage is the MEAN over series, and the max is kept as ``kv_cache_usage_max``. Mean,
  because DP ranks of one instance have equal-sized KV pools, so the mean is the fraction of
  the instance's KV capacity in use (consistent with running/waiting being summed), and
  vLLM's DP coordinator steers new requests away from a full rank, so one full rank does
  not make the instance full.
* SGLang (and any engine) with ``tp_rank``/``pp_rank``/``moe_ep_rank`` labels: only the
  series of the lowest rank is kept (TP/PP/EP ranks repeat the same scheduler numbers);
  ``dp_rank``/``engine_type`` series are aggregated as above.
* ``*_created`` samples are ignored; samples without HELP/TYPE are used like any other;
  label order, integer vs ``.0`` vs scientific values do not matter (prometheus_client).

Bad, empty and truncated input
------------------------------
* Only the lines of the metric families above are parsed (their samples, HELP and TYPE;
  ``_kept``): an engine's hundreds of other lines cost nothing, and a malformed one cuts nothing.
* Empty body -> ParseError. HELP/TYPE-only body (vLLM multiprocess mis-config) or a body
  with none of the engine names above -> ParseError("no engine metrics ..."). An engine
  before its first request exposes its gauges at 0; that is a valid sample of zeros.
* Truncated scrapes (cut mid-line, mid-histogram, dangling ``# HELP``): an unterminated last
  line is dropped (a value cut short would still parse, wrongly). If prometheus_client
  raises, the LONGEST VALID PREFIX OF LINES is parsed instead and ``truncated`` is set, so a
  cut tail does not lose the whole scrape. A histogram cut before ``_count`` and ``+Inf`` has
  no total and is reported as absent. If not even the first line parses -> ParseError.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from laswrr.collectors.errors import ParseError
from laswrr.schemas.events import EngineSampled

__all__ = [
    "EngineKind",
    "EngineMetrics",
    "Histogram",
    "exposition_samples",
    "ParseError",
    "engine_sample",
    "parse_engine_metrics",
]

EngineKind = Literal["vllm", "mindie", "sglang"]
_RANK_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank")
_KV_TOLERANCE = 1e-6


@dataclass(frozen=True)
class _Names:
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv: tuple[str, ...]  # first name with samples wins
    ttft: str
    e2e: str
    prefix_queries: str = ""  # counter of prompt tokens looked up in the prefix cache ("": none)
    prefix_hits: str = ""  # counter of those found cached
    cache_hit_rate: str = ""  # gauge, a fraction

    def all(self) -> tuple[str, ...]:
        return (*self.running, *self.waiting, *self.kv, self.ttft, self.e2e)


_NAMES: dict[EngineKind, _Names] = {
    "vllm": _Names(
        running=("vllm:num_requests_running",),
        waiting=("vllm:num_requests_waiting",),
        kv=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        ttft="vllm:time_to_first_token_seconds",
        e2e="vllm:e2e_request_latency_seconds",
        prefix_queries="vllm:prefix_cache_queries_total",
        prefix_hits="vllm:prefix_cache_hits_total",
    ),
    "sglang": _Names(
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        kv=("sglang:token_usage",),
        ttft="sglang:time_to_first_token_seconds",
        e2e="sglang:e2e_request_latency_seconds",
        cache_hit_rate="sglang:cache_hit_rate",
    ),
    "mindie": _Names(
        running=("num_requests_running",),
        waiting=("num_requests_waiting",),
        kv=("npu_cache_usage_perc",),
        ttft="time_to_first_token_seconds",
        e2e="e2e_request_latency_seconds",
    ),
}


# Every metric family parse_engine_metrics reads, of any engine: the lines it parses (``_kept``).
_FAMILIES = tuple(sorted({name for names in _NAMES.values() for name in (
    *names.all(), names.prefix_queries.removesuffix("_total"), names.prefix_hits.removesuffix("_total"),
    names.cache_hit_rate) if name}))


@dataclass(frozen=True)
class Histogram:
    """Cumulative totals of one latency histogram (seconds), summed over series.

    ``sum`` is None when the engine exposes no ``_sum`` (MindIE TTFT). ``buckets`` are
    ``(le, cumulative count)`` sorted by ``le``; ``math.inf`` is the ``+Inf`` bucket.
    """

    sum: float | None
    count: float
    buckets: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class EngineMetrics:
    """One scrape, reduced to what the router uses. None = the scrape has no such metric."""

    engine: EngineKind
    running: int | None
    waiting: int | None
    kv_cache_usage: float | None  # mean over series, 0..1
    kv_cache_usage_max: float | None  # max over series, 0..1
    ttft: Histogram | None
    e2e: Histogram | None
    models: tuple[str, ...] = ()
    truncated: bool = False
    prefix_cache_queries: float | None = None  # tokens looked up, cumulative (vLLM)
    prefix_cache_hits: float | None = None  # tokens found cached, cumulative (vLLM)
    cache_hit_rate: float | None = None  # SGLang's gauge, 0..1


# --------------------------------------------------------------------------- text -> samples


def _parse_samples(text: str) -> list[Sample]:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


@functools.lru_cache(maxsize=256)
def _parse_kept(text: str) -> tuple[Sample, ...]:
    """``_parse_samples`` of a text of the engine families alone, remembered: an idle engine's
    gauges, histograms and counters say the same at every scrape (what else its exposition
    carries, process metrics say, is cut away by ``_kept`` first), and parsing costs a few
    milliseconds where the comparison costs microseconds. 256 texts: a few per polled node."""
    return tuple(_parse_samples(text))


def _parses(text: str) -> bool:
    try:
        _parse_samples(text)
    except Exception:  # noqa: BLE001 - prometheus_client raises ValueError, IndexError, ...
        return False
    return True


def _longest_valid_prefix(lines: list[str]) -> int:
    """Number of leading lines that prometheus_client accepts as a whole."""
    end = next((i for i, line in enumerate(lines) if not _parses(line + "\n")), len(lines))
    while end > 0 and not _parses("\n".join(lines[:end]) + "\n"):
        end -= 1
    return end


def _kept(text: str, families: tuple[str, ...]) -> str:
    """The lines of ``families`` alone (their samples, HELP and TYPE; a name matches a family it
    starts with: ``_bucket``, ``_sum``, ``_total`` ...); "" when none. prometheus_client parses
    tens of microseconds a line, and a real vLLM exposes hundreds of lines the router never reads
    (304 in tests/fixtures/real's mid-2025 vLLM: 24 -> 2 ms a scrape)."""
    kept = [line for line in text.split("\n")
            if (line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line).startswith(families)]
    return "\n".join(kept) + "\n" if kept else ""


def _samples(text: str, families: tuple[str, ...] = ()) -> tuple[list[Sample], bool]:
    """``families``: parse only their lines (``_kept``), unless the text has none (then the whole
    text, so that what is not an exposition still says so)."""
    text = text.replace("\r\n", "\n")
    cut = False
    if not text.endswith("\n") and "\n" in text:
        # A complete exposition ends with a newline; an unterminated last line may be a value
        # cut short ("3" of "38.0") that would still parse, so it is dropped.
        text, cut = text[: text.rindex("\n") + 1], True
    kept = _kept(text, families) if families else ""
    try:
        return (list(_parse_kept(kept)) if kept else _parse_samples(text)), cut
    except Exception as exc:  # noqa: BLE001 - recover from a truncated tail below
        lines = (kept or text).split("\n")
        end = _longest_valid_prefix(lines)
        if end == 0:
            raise ParseError(f"not a Prometheus text exposition: line 1: {exc}") from None
        return _parse_samples("\n".join(lines[:end]) + "\n"), True


def exposition_samples(text: str) -> tuple[list[Sample], bool]:
    """The samples of a Prometheus text exposition and whether its tail was cut (the recovery
    rules of the module doc); ParseError when not even the first line parses. Shared with the
    npu-exporter parser (collectors.npu_exporter)."""
    return _samples(text)


# --------------------------------------------------------------------------- selection


def _rank_key(value: str) -> tuple[int, float, str]:
    try:
        return (0, float(value), value)
    except ValueError:
        return (1, 0.0, value)


def _lowest_ranks(samples: list[Sample]) -> list[Sample]:
    for label in _RANK_LABELS:
        values = {s.labels[label] for s in samples if label in s.labels}
        if values:
            keep = min(values, key=_rank_key)
            samples = [s for s in samples if s.labels.get(label, keep) == keep]
    return samples


def _by_name(samples: Iterable[Sample], name: str) -> list[Sample]:
    return [s for s in samples if s.name == name]


def _finite(sample: Sample) -> float:
    value = float(sample.value)
    if math.isnan(value) or math.isinf(value):
        raise ParseError(f"{sample.name}{dict(sample.labels)} = {value}: not a finite number")
    return value


def _count_gauge(samples: list[Sample], names: tuple[str, ...]) -> int | None:
    for name in names:
        series = _by_name(samples, name)
        if series:
            total = sum(_finite(s) for s in series)
            if total < 0:
                raise ParseError(f"{name} = {total:g}: a request count cannot be negative")
            return int(round(total))
    return None


def _kv(samples: list[Sample], names: tuple[str, ...]) -> tuple[float | None, float | None]:
    for name in names:
        values = [_finite(s) for s in _by_name(samples, name)]
        if values:
            bad = [v for v in values if not -_KV_TOLERANCE <= v <= 1.0 + _KV_TOLERANCE]
            if bad:
                raise ParseError(f"{name} = {bad[0]:g}: KV usage must be a fraction 0..1")
            clamped = [min(1.0, max(0.0, v)) for v in values]
            return sum(clamped) / len(clamped), max(clamped)
    return None, None


def _total(samples: list[Sample], name: str) -> float | None:
    """The sum of a counter's series; None when the engine has no such counter."""
    series = _by_name(samples, name) if name else []
    if not series:
        return None
    total = sum(_finite(s) for s in series)
    if total < 0:
        raise ParseError(f"{name} = {total:g}: a counter cannot be negative")
    return total


def _fraction(samples: list[Sample], name: str) -> float | None:
    values = [_finite(s) for s in _by_name(samples, name)] if name else []
    if not values:
        return None
    if any(not -_KV_TOLERANCE <= v <= 1.0 + _KV_TOLERANCE for v in values):
        raise ParseError(f"{name}: must be a fraction 0..1, got {values}")
    return min(1.0, max(0.0, sum(values) / len(values)))


def _le(sample: Sample) -> float:
    raw = sample.labels.get("le")
    try:
        return float(raw) if raw is not None else math.nan
    except ValueError:
        raise ParseError(f"{sample.name}: bucket bound le={raw!r} is not a number") from None


def _histogram(samples: list[Sample], base: str) -> Histogram | None:
    sums = _by_name(samples, base + "_sum")
    counts = _by_name(samples, base + "_count")
    bucket_totals: dict[float, float] = {}
    for sample in _by_name(samples, base + "_bucket"):
        le = _le(sample)
        if not math.isnan(le):
            bucket_totals[le] = bucket_totals.get(le, 0.0) + _finite(sample)
    if counts:
        count = sum(_finite(s) for s in counts)
    elif math.inf in bucket_totals:
        count = bucket_totals[math.inf]
    else:
        return None  # absent, or cut before _count and +Inf
    series = {_series_key(s) for s in (*counts, *_by_name(samples, base + "_bucket"))}
    has_all_sums = bool(sums) and {_series_key(s) for s in sums} >= series
    total = sum(_finite(s) for s in sums) if has_all_sums else None
    return Histogram(sum=total, count=count, buckets=tuple(sorted(bucket_totals.items())))


def _series_key(sample: Sample) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))


def _detect(samples: list[Sample], engine: EngineKind | Literal["auto"]) -> EngineKind:
    present = {s.name for s in samples}
    candidates: tuple[EngineKind, ...] = ("vllm", "sglang", "mindie") if engine == "auto" else (engine,)
    for kind in candidates:
        names = _NAMES[kind]
        wanted = set(names.all()) | {f"{names.ttft}_count", f"{names.e2e}_count", f"{names.ttft}_bucket",
                                     f"{names.e2e}_bucket", f"{names.ttft}_sum", f"{names.e2e}_sum"}
        if present & wanted:
            return kind
    which = "vLLM/SGLang/MindIE" if engine == "auto" else engine
    raise ParseError(f"no engine metrics: none of the {which} running/waiting/KV/latency names found")


def _models(samples: list[Sample]) -> tuple[str, ...]:
    return tuple(sorted({s.labels["model_name"] for s in samples if s.labels.get("model_name")}))


# --------------------------------------------------------------------------- public


def parse_engine_metrics(
    text: str, engine: EngineKind | Literal["auto"] = "auto"
) -> EngineMetrics:
    """Reduce one ``/metrics`` body to running, waiting, KV usage and latency histograms.

    ``engine="auto"`` detects vLLM (``vllm:``), SGLang (``sglang:``) or MindIE (unprefixed
    names). Raises ParseError for an empty body, text that is not an exposition, or one with
    none of the selected engine's metrics.
    """
    if engine not in ("auto", *_NAMES):
        raise ParseError(f"unknown engine {engine!r}: expected vllm, mindie, sglang or auto")
    if not text.strip():
        raise ParseError("empty /metrics body")
    samples, truncated = _samples(text, _FAMILIES)
    samples = _lowest_ranks([s for s in samples if not s.name.endswith("_created")])
    if not samples:
        raise ParseError("no engine metrics: the body has only HELP/TYPE lines, no samples")
    kind = _detect(samples, engine)
    names = _NAMES[kind]
    kv_mean, kv_max = _kv(samples, names.kv)
    return EngineMetrics(
        engine=kind,
        running=_count_gauge(samples, names.running),
        waiting=_count_gauge(samples, names.waiting),
        kv_cache_usage=kv_mean,
        kv_cache_usage_max=kv_max,
        ttft=_histogram(samples, names.ttft),
        e2e=_histogram(samples, names.e2e),
        models=_models(samples),
        truncated=truncated,
        prefix_cache_queries=_total(samples, names.prefix_queries),
        prefix_cache_hits=_total(samples, names.prefix_hits),
        cache_hit_rate=_fraction(samples, names.cache_hit_rate),
    )


def _bucket_mean(prev: Histogram, cur: Histogram) -> float | None:
    """Mean of the new observations from bucket deltas, each at its bucket's midpoint.

    The first bucket counts at half its bound; the ``+Inf`` bucket at the last finite bound
    (so a heavy tail is under-estimated). None when the bucket bounds changed or a bucket
    went down (reset).
    """
    if [le for le, _ in prev.buckets] != [le for le, _ in cur.buckets] or not cur.buckets:
        return None
    total = weighted = 0.0
    lower = previous_cum = 0.0
    for (le, cum_cur), (_, cum_prev) in zip(cur.buckets, prev.buckets, strict=True):
        delta_cum = cum_cur - cum_prev
        in_bucket = delta_cum - previous_cum
        if delta_cum < 0 or in_bucket < 0:
            return None
        point = lower if math.isinf(le) else (lower + le) / 2.0
        weighted += in_bucket * point
        total += in_bucket
        previous_cum = delta_cum
        lower = lower if math.isinf(le) else le
    return weighted / total if total > 0 else None


def _mean_ms(prev: Histogram | None, cur: Histogram | None) -> float | None:
    if prev is None or cur is None:
        return None
    new = cur.count - prev.count
    if new <= 0:  # no finished requests, or a counter reset (count went down)
        return None
    if cur.sum is not None and prev.sum is not None:
        spent = cur.sum - prev.sum
        return None if spent < 0 else spent / new * 1000.0
    mean = _bucket_mean(prev, cur)
    return None if mean is None else mean * 1000.0


def engine_sample(prev: EngineMetrics | None, cur: EngineMetrics, *, ts_ns: int | None = None) -> EngineSampled:
    """The ``EngineSampled`` event for scrape ``cur``, latencies averaged since ``prev``.

    ``ttft_ms``/``e2e_ms`` are the MEAN over requests finished between the two scrapes
    (``_sum``/``_count`` deltas); None with no ``prev``, no new requests, a counter reset,
    or a different engine kind in ``prev``. Without ``_sum`` (MindIE TTFT) the mean is
    ESTIMATED from bucket deltas at bucket midpoints (see ``_bucket_mean``). Raises
    ParseError when ``cur`` lacks running, waiting or KV usage.
    """
    running, waiting, kv = cur.running, cur.waiting, cur.kv_cache_usage
    if running is None or waiting is None or kv is None:
        missing = [f for f in ("running", "waiting", "kv_cache_usage") if getattr(cur, f) is None]
        raise ParseError(f"{cur.engine} metrics lack {', '.join(missing)}: cannot build EngineSampled")
    base = prev if prev is not None and prev.engine == cur.engine else None
    return EngineSampled(
        running=running,
        waiting=waiting,
        kv_cache_usage=kv,
        ttft_ms=_mean_ms(base.ttft if base else None, cur.ttft),
        e2e_ms=_mean_ms(base.e2e if base else None, cur.e2e),
        engine=cur.engine,
        ts_ns=ts_ns,
        prefix_cache_queries=cur.prefix_cache_queries,
        prefix_cache_hits=cur.prefix_cache_hits,
    )
