"""Trace replay: parsing the Mooncake and Azure formats, windows, and prompts that share text
exactly where the trace's hash_ids agree."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from laswrr.bench.cli import BENCH_SCENARIOS, bench_workload, trace_override
from laswrr.bench.scenarios import SCENARIOS, TRACE_MOONCAKE, get_scenario
from laswrr.bench.trace import (TRACES_DIR, TraceError, TraceRow, TraceWindow, arrival_bursts, load_workload, parse_azure,
                                parse_mooncake, read_trace, select, spread_bursts)
from laswrr.bench.workload import TRACE_BLOCK_CHARS, RequestSpec, prompt_text
from laswrr.services.sim_engine.openai_api import parse_request
from laswrr.services.sim_engine.prefix_cache import block_keys

MOONCAKE = TRACES_DIR / "mooncake_conversation_first300s.jsonl"
AZURE = TRACES_DIR / "azure2023_code_first300s.csv"


def test_the_repository_slices_parse_whole() -> None:
    mooncake, azure = read_trace(MOONCAKE), read_trace(AZURE)
    assert len(mooncake) == 918 and len(azure) == 781
    assert mooncake[0].hash_ids[:3] == (0, 1, 2) and mooncake[0].prompt_tokens == 6758
    assert max(r.at_s for r in mooncake) < 300 and all(r.hash_ids[0] == 0 for r in mooncake)
    assert (azure[0].at_s, azure[0].prompt_tokens, azure[0].output_tokens) == (0.0, 4808, 10)
    assert azure[1].at_s == pytest.approx(0.052)  # 18:17:04.0319600 - 18:17:03.9799600
    assert all(a.at_s <= b.at_s for a, b in zip(azure, azure[1:]))


def test_window_and_speed() -> None:
    rows = parse_mooncake(['{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}',
                           '{"timestamp": 4000, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}',
                           '{"timestamp": 9000, "input_length": 20, "output_length": 1, "hash_ids": [5]}'])
    requests = select(rows, TraceWindow("x", start_s=2.0, window_s=10.0, speed=2.0))
    assert [(r.index, r.offset_s, r.prompt_tokens, r.max_tokens, r.block_ids) for r in requests] == [
        (0, 1.0, 600, 3, (0, 1)), (1, 3.5, 20, 1, (5,))]


@pytest.mark.parametrize(("lines", "match"), [
    (['{"timestamp": 0, "input_length": 0, "output_length": 2}'], "t:1: ValueError: input_length"),
    (['{"timestamp": 0, "output_length": 2}'], "t:1: KeyError"),
    (["", "not json"], "t:2"),
    (['{"timestamp": -1, "input_length": 1, "output_length": 1}'], "timestamp"),
    (['{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": ["a"]}'], "hash_ids"),
    ([], "no rows"),
])
def test_bad_mooncake_rows_name_the_line(lines: list[str], match: str) -> None:
    with pytest.raises(TraceError, match=match):
        parse_mooncake(lines, "t")


def test_bad_azure_input_names_the_line() -> None:
    header = "TIMESTAMP,ContextTokens,GeneratedTokens"
    with pytest.raises(TraceError, match="t:1: expected the header"):
        parse_azure(["a,b,c"], "t")
    with pytest.raises(TraceError, match="t:3"):
        parse_azure([header, "2023-11-16 18:17:03.9799600,4808,10", "2023-11-16 18:17:04.03,x,8"], "t")
    with pytest.raises(TraceError, match="unknown trace format"):
        read_trace(Path("trace.txt"))
    with pytest.raises(TraceError, match="no rows in"):
        load_workload(TraceWindow(str(MOONCAKE), start_s=10_000.0))


def _spec(index: int, tokens: int, ids: tuple[int, ...]) -> RequestSpec:
    return RequestSpec(index, 0.0, tokens, 1, None, block_ids=ids)


def test_prompts_share_text_exactly_where_the_hash_ids_do() -> None:
    a, b = prompt_text(_spec(0, 1500, (0, 1, 2))), prompt_text(_spec(1, 1400, (0, 1, 7)))
    common = os.path.commonprefix([a, b])
    assert 2 * TRACE_BLOCK_CHARS <= len(common) < 2 * TRACE_BLOCK_CHARS + 64  # two blocks, not a third
    c = prompt_text(_spec(2, 1500, (9, 1, 2)))
    assert len(os.path.commonprefix([a, c])) < 64  # a different first id: nothing shared for the engine
    # the simulated engine counts the trace's tokens and sees the shared blocks as cached keys
    parsed = parse_request({"messages": [{"role": "user", "content": a}]}, "chat", "m")
    assert parsed.prompt_tokens == 1500
    ka, kb = block_keys(a, 16, 1500 // 16), block_keys(b, 16, 1400 // 16)
    assert ka[:64] == kb[:64] and ka[64] != kb[64]  # 2 × 512 tokens = 64 blocks of 16 shared


def test_trace_scenarios_are_in_all_and_take_the_flags() -> None:
    assert {"trace-mooncake", "trace-azure-code"} <= set(BENCH_SCENARIOS)
    assert "smoke-trace" not in BENCH_SCENARIOS and "smoke-trace" in SCENARIOS
    args = argparse.Namespace(trace=None, speed=4.0, start_s=60.0, window_s=30.0, spread_bursts=False)
    scenario = trace_override(TRACE_MOONCAKE, args)
    scenario, requests = bench_workload(scenario, seed=1)
    assert scenario.trace == TraceWindow("mooncake_conversation_first300s.jsonl", 60.0, 30.0, 4.0)
    assert scenario.phases[-1].end_s == 7.5 and all(0 <= r.offset_s < 7.5 for r in requests)
    full = trace_override(TRACE_MOONCAKE, argparse.Namespace(trace=MOONCAKE, speed=None, start_s=None, window_s=None,
                                                             spread_bursts=False))
    assert full.trace is not None and full.trace.window_s is None and full.trace.path == str(MOONCAKE)
    with pytest.raises(ValueError, match="need a trace scenario"):
        trace_override(get_scenario("bursty"), args)


def test_spread_bursts_spaces_the_rows_of_a_stamp_up_to_the_next_one() -> None:
    rows = [TraceRow(0.0, 1, 1), TraceRow(0.0, 2, 1), TraceRow(0.0, 3, 1), TraceRow(3.0, 4, 1), TraceRow(3.0, 5, 1)]
    spread = spread_bursts(rows, end_s=5.0)
    assert [(r.at_s, r.prompt_tokens) for r in spread] == [(0.0, 1), (1.0, 2), (2.0, 3), (3.0, 4), (4.0, 5)]
    assert [r.at_s for r in spread_bursts(rows)] == [0.0, 1.0, 2.0, 3.0, 4.5]  # no end: the mean step
    assert spread_bursts(rows[:1]) == rows[:1]
    # the repository's Mooncake slice: 918 requests on 100 stamps, then on 918 instants, in order
    window = replace(TRACE_MOONCAKE.trace, spread=True)
    together, apart = load_workload(replace(window, spread=False)), load_workload(window)
    assert len({r.offset_s for r in together}) == 100 and len({r.offset_s for r in apart}) == len(apart) == 918
    assert [r.block_ids for r in apart] == [r.block_ids for r in together]
    assert all(a.offset_s >= t.offset_s for a, t in zip(apart, together))
    args = argparse.Namespace(trace=None, speed=None, start_s=None, window_s=None, spread_bursts=True)
    assert trace_override(TRACE_MOONCAKE, args).trace == window
    with pytest.raises(ValueError, match="need a trace scenario"):
        trace_override(get_scenario("bursty"), args)


def test_arrival_bursts() -> None:
    assert arrival_bursts([0.1, 0.2, 0.9, 1.5, 3.0], 4.0) == {"requests": 5, "mean_per_s": 1.25, "peak_per_s": 3}


def test_slices_are_leading_lines_of_the_sources() -> None:
    # provenance: bench/traces/SOURCES.md; the first line of each is the source's first row
    first = json.loads(MOONCAKE.read_text().splitlines()[0])
    assert first == {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": list(range(14))}
    assert AZURE.read_text().splitlines()[1] == "2023-11-16 18:17:03.9799600,4808,10"


def test_an_empty_window_is_a_clear_error_with_spread_bursts_too() -> None:
    assert spread_bursts([], end_s=5.0) == []
    window = replace(TRACE_MOONCAKE.trace, start_s=10_000.0, window_s=10.0, spread=True)
    with pytest.raises(TraceError, match="no rows"):
        load_workload(window)
