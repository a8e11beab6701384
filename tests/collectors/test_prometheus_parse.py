"""parse_engine_metrics / engine_sample against the real /metrics captures (values read by eye)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from laswrr.collectors.errors import ParseError
from laswrr.collectors import prometheus
from laswrr.collectors.prometheus import EngineMetrics, Histogram, engine_sample, parse_engine_metrics

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real"


def _read(name: str) -> str:
    return (REAL / name).read_text(encoding="utf-8")


# file -> (engine, running, waiting, kv, (ttft_sum, ttft_count) | None, (e2e_sum, e2e_count) | None, models)
EXPECTED: dict[str, tuple] = {
    "vllm-metrics_v0_0.5-0.6era_idle_Llama-3.1-8B_partial.txt": (
        "vllm", 0, 0, 0.0, None, None, ("meta-llama/Llama-3.1-8B-Instruct",),
    ),
    "vllm-metrics_v0_0.7era_aibrix-doc_Qwen2.5-Coder-1.5B_truncated.txt": (
        "vllm", 0, 0, 0.0, None, None, ("Qwen/Qwen2.5-Coder-1.5B-Instruct",),
    ),
    "vllm-metrics_v0-layout_mid2025_Qwen3-0.6B_full.txt": (
        "vllm", 0, 0, 0.0, (4941.843970537186, 69.0), (902.0056705474854, 38.0), ("Qwen/Qwen3-0.6B",),
    ),
    "vllm-metrics_v1_2026_kserve-llama-vllm-single_head40.txt": (
        "vllm", 0, 0, 0.0, None, None, ("llama-vllm-single",),
    ),
    "vllm-metrics_v1_2026_cache-lines_Qwen3.6-27B_trimmed.txt": (
        "vllm", None, None, 0.0, None, None, ("Lorbus/Qwen3.6-27B-int4-AutoRound",),
    ),
    "sglang-metrics_v0.4-docs_llama3.1-8b.txt": (
        "sglang", 162, 2826, 0.28, (2.3518979474117756e06, 11008.0), (3.116093850019932e06, 11228.0),
        ("meta-llama/Llama-3.1-8B-Instruct",),
    ),
    "mindie-metrics_coordinator-doc_llama3-8b.txt": (
        "mindie", 0, 0, 1.0, (None, 2523.0), (12684.5319980979, 2267.0), ("llama3-8b",),
    ),
}


def _totals(histogram: Histogram | None) -> tuple[float | None, float] | None:
    return None if histogram is None else (histogram.sum, histogram.count)


def test_every_metrics_fixture_is_covered() -> None:
    on_disk = {p.name for p in REAL.glob("*metrics*.txt")}
    assert on_disk == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_values(name: str) -> None:
    engine, running, waiting, kv, ttft, e2e, models = EXPECTED[name]
    metrics = parse_engine_metrics(_read(name))
    assert (metrics.engine, metrics.running, metrics.waiting) == (engine, running, waiting)
    assert metrics.kv_cache_usage == pytest.approx(kv)
    assert metrics.kv_cache_usage_max == pytest.approx(kv)
    assert _totals(metrics.ttft) == ttft
    assert _totals(metrics.e2e) == e2e
    assert metrics.models == models
    assert metrics.truncated is False


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_parses_with_its_explicit_engine(name: str) -> None:
    engine = EXPECTED[name][0]
    assert parse_engine_metrics(_read(name), engine) == parse_engine_metrics(_read(name))


def test_wrong_explicit_engine_raises() -> None:
    with pytest.raises(ParseError, match="no engine metrics"):
        parse_engine_metrics(_read("mindie-metrics_coordinator-doc_llama3-8b.txt"), "vllm")
    with pytest.raises(ParseError):
        parse_engine_metrics(_read("vllm-metrics_v0-layout_mid2025_Qwen3-0.6B_full.txt"), "sglang")


def test_bucket_details() -> None:
    mindie = parse_engine_metrics(_read("mindie-metrics_coordinator-doc_llama3-8b.txt"))
    assert mindie.ttft is not None
    assert mindie.ttft.buckets[0] == (0.001, 0.0)
    assert mindie.ttft.buckets[5] == (0.06, 10.0)
    assert mindie.ttft.buckets[-1] == (math.inf, 2523.0)
    assert len(mindie.ttft.buckets) == 17
    vllm = parse_engine_metrics(_read("vllm-metrics_v0-layout_mid2025_Qwen3-0.6B_full.txt"))
    assert vllm.e2e is not None and dict(vllm.e2e.buckets)[20.0] == 28.0 and len(vllm.e2e.buckets) == 22


def test_sample_of_real_fixtures_without_prev() -> None:
    sample = engine_sample(None, parse_engine_metrics(_read("sglang-metrics_v0.4-docs_llama3.1-8b.txt")))
    assert (sample.running, sample.waiting, sample.kv_cache_usage, sample.engine) == (162, 2826, 0.28, "sglang")
    assert sample.ttft_ms is None and sample.e2e_ms is None
    sample = engine_sample(None, parse_engine_metrics(_read("mindie-metrics_coordinator-doc_llama3-8b.txt")))
    assert (sample.running, sample.waiting, sample.kv_cache_usage) == (0, 0, 1.0)


def test_sample_needs_running_waiting_and_kv() -> None:
    trimmed = parse_engine_metrics(_read("vllm-metrics_v1_2026_cache-lines_Qwen3.6-27B_trimmed.txt"))
    with pytest.raises(ParseError, match="running, waiting"):
        engine_sample(None, trimmed)


# ------------------------------------------------------------------ synthetic expositions


def vllm_text(
    running: float = 0, waiting: float = 0, kv: float = 0.0, ttft: tuple[float, float] = (0.0, 0),
    e2e: tuple[float, float] = (0.0, 0), engine: str = "0",
) -> str:
    labels = f'engine="{engine}",model_name="m"'
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{labels}}} {running}\n"
        f"vllm:num_requests_waiting{{{labels}}} {waiting}\n"
        f"vllm:kv_cache_usage_perc{{{labels}}} {kv}\n"
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} {ttft[1]}\n'
        f"vllm:time_to_first_token_seconds_count{{{labels}}} {ttft[1]}\n"
        f"vllm:time_to_first_token_seconds_sum{{{labels}}} {ttft[0]}\n"
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        f'vllm:e2e_request_latency_seconds_bucket{{{labels},le="+Inf"}} {e2e[1]}\n'
        f"vllm:e2e_request_latency_seconds_count{{{labels}}} {e2e[1]}\n"
        f"vllm:e2e_request_latency_seconds_sum{{{labels}}} {e2e[0]}\n"
    )


def test_engine_before_first_request_is_a_sample_of_zeros() -> None:
    metrics = parse_engine_metrics(vllm_text())
    sample = engine_sample(None, metrics)
    assert (sample.running, sample.waiting, sample.kv_cache_usage, sample.ttft_ms) == (0, 0, 0.0, None)
    assert metrics.ttft == Histogram(sum=0.0, count=0.0, buckets=((math.inf, 0.0),))


def test_mean_latency_over_requests_finished_between_scrapes() -> None:
    prev = parse_engine_metrics(vllm_text(ttft=(10.0, 20), e2e=(100.0, 20)))
    cur = parse_engine_metrics(vllm_text(running=7, waiting=2, kv=0.5, ttft=(12.0, 24), e2e=(130.0, 23)))
    sample = engine_sample(prev, cur, ts_ns=123)
    assert (sample.running, sample.waiting, sample.kv_cache_usage, sample.ts_ns) == (7, 2, 0.5, 123)
    assert sample.ttft_ms == pytest.approx(500.0)  # 2 s over 4 requests
    assert sample.e2e_ms == pytest.approx(10_000.0)  # 30 s over 3 requests


def test_no_new_requests_gives_none() -> None:
    text = vllm_text(ttft=(10.0, 20), e2e=(100.0, 20))
    sample = engine_sample(parse_engine_metrics(text), parse_engine_metrics(text))
    assert sample.ttft_ms is None and sample.e2e_ms is None


def test_counter_reset_gives_none() -> None:
    prev = parse_engine_metrics(vllm_text(ttft=(10.0, 20), e2e=(100.0, 20)))
    cur = parse_engine_metrics(vllm_text(ttft=(1.0, 3), e2e=(5.0, 2)))
    sample = engine_sample(prev, cur)
    assert sample.ttft_ms is None and sample.e2e_ms is None


def test_prev_of_another_engine_kind_is_ignored() -> None:
    prev = parse_engine_metrics(_read("sglang-metrics_v0.4-docs_llama3.1-8b.txt"))
    cur = parse_engine_metrics(vllm_text(ttft=(10.0, 20)))
    assert engine_sample(prev, cur).ttft_ms is None


def test_v1_engines_are_summed_and_kv_is_mean_with_max_kept() -> None:
    text = vllm_text(running=3, waiting=1, kv=0.2, ttft=(1.0, 2), engine="0") + vllm_text(
        running=5, waiting=0, kv=0.6, ttft=(3.0, 4), engine="1"
    ).replace("# TYPE vllm:num_requests_running gauge\n", "")
    metrics = parse_engine_metrics(text)
    assert (metrics.running, metrics.waiting) == (8, 1)
    assert metrics.kv_cache_usage == pytest.approx(0.4)
    assert metrics.kv_cache_usage_max == pytest.approx(0.6)
    assert _totals(metrics.ttft) == (4.0, 6.0)


def test_new_kv_name_preferred_over_deprecated_alias() -> None:
    text = vllm_text(kv=0.3) + 'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9\n'
    assert parse_engine_metrics(text).kv_cache_usage == pytest.approx(0.3)


def test_sglang_keeps_lowest_tp_rank() -> None:
    rows = []
    for rank, running in (("1", 50), ("0", 10)):
        labels = f'model_name="m",engine_type="unified",tp_rank="{rank}",pp_rank="0"'
        rows += [
            f"sglang:num_running_reqs{{{labels}}} {running}",
            f"sglang:num_queue_reqs{{{labels}}} {running + 1}",
            f"sglang:token_usage{{{labels}}} 0.{rank}5",
        ]
    metrics = parse_engine_metrics("\n".join(rows) + "\n")
    assert (metrics.engine, metrics.running, metrics.waiting) == ("sglang", 10, 11)
    assert metrics.kv_cache_usage == pytest.approx(0.05)


def _mindie_ttft(buckets: dict[str, int], count: int) -> str:
    lines = [
        "num_requests_running{model_name=\"m\"} 1",
        "num_requests_waiting{model_name=\"m\"} 0",
        "npu_cache_usage_perc{model_name=\"m\"} 0.25",
        "# TYPE time_to_first_token_seconds histogram",
        f"time_to_first_token_seconds_count{{model_name=\"m\"}} {count}",
    ]
    lines += [f'time_to_first_token_seconds_bucket{{model_name="m",le="{le}"}} {n}' for le, n in buckets.items()]
    return "\n".join(lines) + "\n"


def test_mindie_ttft_without_sum_is_estimated_from_bucket_midpoints() -> None:
    prev = parse_engine_metrics(_mindie_ttft({"0.1": 5, "0.25": 5, "0.5": 5, "+Inf": 5}, 5))
    cur = parse_engine_metrics(_mindie_ttft({"0.1": 5, "0.25": 7, "0.5": 8, "+Inf": 8}, 8))
    assert cur.ttft is not None and cur.ttft.sum is None
    sample = engine_sample(prev, cur)
    # 2 new in (0.1, 0.25] at 0.175 s, 1 new in (0.25, 0.5] at 0.375 s
    assert sample.ttft_ms == pytest.approx((2 * 175.0 + 375.0) / 3)
    assert sample.kv_cache_usage == 0.25


def test_mindie_ttft_estimate_counts_inf_bucket_at_last_bound() -> None:
    prev = parse_engine_metrics(_mindie_ttft({"1": 0, "+Inf": 0}, 0))
    cur = parse_engine_metrics(_mindie_ttft({"1": 1, "+Inf": 2}, 2))
    assert engine_sample(prev, cur).ttft_ms == pytest.approx((500.0 + 1000.0) / 2)


def test_mindie_ttft_estimate_with_changed_buckets_is_none() -> None:
    prev = parse_engine_metrics(_mindie_ttft({"1": 0, "+Inf": 0}, 0))
    cur = parse_engine_metrics(_mindie_ttft({"2": 1, "+Inf": 2}, 2))
    assert engine_sample(prev, cur).ttft_ms is None


def test_created_samples_are_ignored() -> None:
    text = vllm_text() + 'vllm:num_requests_running_created{engine="0",model_name="m"} 1.7e9\n'
    assert parse_engine_metrics(text).running == 0


# ------------------------------------------------------------------ truncation and bad input


def test_truncated_mid_label_keeps_the_valid_prefix() -> None:
    text = _read("vllm-metrics_v0-layout_mid2025_Qwen3-0.6B_full.txt")
    cut = text[: text.index('vllm:e2e_request_latency_seconds_bucket{le="5.0"') + 40]
    metrics = parse_engine_metrics(cut)
    assert metrics.truncated is True
    assert _totals(metrics.ttft) == (4941.843970537186, 69.0)
    assert metrics.e2e is None  # cut before _count and +Inf: no total
    assert metrics.running is None  # gauges come after the histograms in this capture


def test_unterminated_last_line_is_dropped() -> None:
    text = vllm_text(running=38)
    cut = text[: text.index("vllm:num_requests_running{") + len('vllm:num_requests_running{engine="0",model_name="m"} 3')]
    cut += "\n" + "vllm:num_requests_waiting"  # a second, unterminated line
    metrics = parse_engine_metrics(cut)
    assert metrics.truncated is True and metrics.running == 3  # "3" was a complete line here


def test_value_cut_short_on_last_line_is_not_misread() -> None:
    full = 'vllm:num_requests_waiting{model_name="m"} 0\nvllm:num_requests_running{model_name="m"} 38.0\n'
    metrics = parse_engine_metrics(full[:-3])  # "... 38" without newline
    assert metrics.running is None and metrics.waiting == 0 and metrics.truncated


def test_dangling_help_line_head40_fixture_parses() -> None:
    text = _read("vllm-metrics_v1_2026_kserve-llama-vllm-single_head40.txt")
    assert text.rstrip("\n").splitlines()[-1].startswith("# HELP")
    assert parse_engine_metrics(text).running == 0


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_prefix_parses_or_raises_parse_error(name: str) -> None:
    text = _read(name)
    for end in range(0, len(text), max(1, len(text) // 150)):
        try:
            metrics = parse_engine_metrics(text[:end])
        except ParseError:
            continue
        assert isinstance(metrics, EngineMetrics)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        pytest.param("", "empty", id="empty"),
        pytest.param(" \n\n", "empty", id="whitespace"),
        pytest.param("# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n", "no engine metrics",
                     id="help-type-only"),
        pytest.param("<html><body>502 Bad Gateway</body></html>\n", "not a Prometheus", id="html"),
        pytest.param("garbage text\nmore garbage\n", "not a Prometheus", id="garbage"),
        pytest.param(bytes(range(256)).decode("latin-1") * 3, None, id="binary-noise"),
        pytest.param("hello 1\nworld 2\n", "no engine metrics", id="valid-but-not-an-engine"),
        pytest.param('vllm:kv_cache_usage_perc{engine="0"} 45\n', "fraction", id="kv-percent-not-fraction"),
        pytest.param('vllm:num_requests_running{engine="0"} NaN\n', "finite", id="nan-gauge"),
        pytest.param('vllm:num_requests_running{engine="0"} -2\n', "negative", id="negative-count"),
    ],
)
def test_bad_input_raises_parse_error(text: str, match: str | None) -> None:
    with pytest.raises(ParseError, match=match):
        parse_engine_metrics(text)


def test_unknown_engine_name_raises_parse_error() -> None:
    with pytest.raises(ParseError):
        parse_engine_metrics(vllm_text(), "triton")  # type: ignore[arg-type]


def test_prefix_cache_counters_of_real_captures() -> None:
    v1 = parse_engine_metrics(_read("vllm-metrics_v1_2026_cache-lines_Qwen3.6-27B_trimmed.txt"))
    assert (v1.prefix_cache_queries, v1.prefix_cache_hits) == (1.0931263819e10, 6.3046928e08)
    idle = parse_engine_metrics(_read("vllm-metrics_v1_2026_kserve-llama-vllm-single_head40.txt"))
    assert idle.prefix_cache_queries == 0.0
    sglang = parse_engine_metrics(_read("sglang-metrics_v0.4-docs_llama3.1-8b.txt"))
    assert sglang.cache_hit_rate == pytest.approx(0.007507552643049313)
    assert sglang.prefix_cache_queries is None
    mindie = parse_engine_metrics(_read("mindie-metrics_coordinator-doc_llama3-8b.txt"))
    assert (mindie.prefix_cache_queries, mindie.prefix_cache_hits, mindie.cache_hit_rate) == (None, None, None)


def test_prefix_cache_counters_are_summed_over_engines() -> None:
    text = ("vllm:num_requests_running{engine=\"0\"} 1\nvllm:num_requests_running{engine=\"1\"} 2\n"
            "vllm:prefix_cache_queries_total{engine=\"0\"} 100\nvllm:prefix_cache_queries_total{engine=\"1\"} 50\n"
            "vllm:prefix_cache_hits_total{engine=\"0\"} 40\nvllm:prefix_cache_hits_total{engine=\"1\"} 10\n")
    parsed = parse_engine_metrics(text)
    assert (parsed.prefix_cache_queries, parsed.prefix_cache_hits) == (150, 50)
    with pytest.raises(ParseError, match="counter cannot be negative"):
        parse_engine_metrics("vllm:num_requests_running 1\nvllm:prefix_cache_hits_total -3\n")


@pytest.mark.parametrize("name", sorted(p.name for p in REAL.glob("*metrics*.txt")))
def test_parsing_only_the_families_read_gives_what_the_whole_exposition_gives(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    text = _read(name)
    try:
        kept = parse_engine_metrics(text)
    except ParseError as exc:
        kept = exc  # type: ignore[assignment]
    monkeypatch.setattr(prometheus, "_FAMILIES", ())  # every line through prometheus_client, as before the filter
    try:
        whole = parse_engine_metrics(text)
    except ParseError as exc:
        whole = exc  # type: ignore[assignment]
    assert repr(kept) == repr(whole)


def test_a_malformed_line_of_a_family_the_router_does_not_read_cuts_nothing() -> None:
    text = ("# TYPE vllm:iteration_tokens_total histogram\nvllm:iteration_tokens_total_bucket{le=\"1\" 3\n"
            "vllm:num_requests_running 2\nvllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.25\n")
    metrics = parse_engine_metrics(text)
    assert (metrics.running, metrics.waiting, metrics.kv_cache_usage, metrics.truncated) == (2, 1, 0.25, False)


def test_an_unchanged_engine_exposition_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two scrapes of an idle engine differ only in what the collector does not read (process
    metrics): the second is not parsed again and says the same; a changed gauge is parsed."""
    text = _read("vllm-metrics_v0-layout_mid2025_Qwen3-0.6B_full.txt") + "process_cpu_seconds_total 12.5\n"
    parses: list[str] = []
    real = prometheus.text_string_to_metric_families

    def counting(body: str):  # type: ignore[no-untyped-def]
        parses.append(body)
        return real(body)

    monkeypatch.setattr(prometheus, "text_string_to_metric_families", counting)
    prometheus._parse_kept.cache_clear()
    first = parse_engine_metrics(text)
    later = parse_engine_metrics(text.replace("process_cpu_seconds_total 12.5", "process_cpu_seconds_total 12.75"))
    assert later == first and len(parses) == 1
    running = next(line for line in text.splitlines() if line.startswith("vllm:num_requests_running"))
    busy = parse_engine_metrics(text.replace(running, running.rsplit(" ", 1)[0] + " 7.0"))
    assert busy.running == 7 and len(parses) == 2
