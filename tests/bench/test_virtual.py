"""`laswrr bench --virtual`: a trace in virtual time through the proxy's routing table (pure, fast)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from laswrr.bench.scenarios import get_scenario
from laswrr.bench.trace import load_workload
from laswrr.bench.virtual import (EXACT, ORACLE, Continuations, PeerTraffic, _snapshot, fleet, fleet_requests, kind_of, rows_for,
                                  run_virtual)
from laswrr.bench.virtual_peers import VirtualChannel
from laswrr.scheduler.routing.router import DEFAULT_POOL, Router
from laswrr.schemas.peers import PeerDelta, PeerState
from laswrr.services.sim_engine.physics import EngineSim
from laswrr.services.sim_engine.profiles import get_profile


def test_a_virtual_run_is_deterministic_and_serves_every_request() -> None:
    scenario = get_scenario("smoke-trace")
    first, again = run_virtual(scenario, "la-swrr"), run_virtual(scenario, "la-swrr")
    assert first == again
    assert first.requests > 0 and sum(first.per_node.values()) == first.requests
    assert 0 < first.ttft_s["p50"] <= first.ttft_s["p99"] <= first.e2e_s["p99"]


def test_prefix_affinity_raises_the_hit_rate_on_the_mooncake_slice() -> None:
    """The slice's conversations share prefixes: affinity must find them (not a speed goal)."""
    mooncake = get_scenario("trace-mooncake")
    assert mooncake.trace is not None
    scenario = replace(mooncake, trace=replace(mooncake.trace, window_s=90.0))
    on, off = run_virtual(scenario, "la-swrr", "prefix"), run_virtual(scenario, "la-swrr", "none")
    assert (on.affinity, off.affinity) == ("prefix", "none")
    assert on.prefix_hit_rate > off.prefix_hit_rate
    assert on.kept_on_node is not None and off.kept_on_node is not None and on.kept_on_node > off.kept_on_node
    two = run_virtual(scenario, "la-swrr", "prefix", proxies=2)
    assert two.proxies == 2 and two.requests == on.requests and two.kept_on_node is not None


def test_the_engines_exact_view_finds_at_least_the_estimates_hits() -> None:
    """``--kv-events``: the routers fed the engines' KV events hit the cache at least as often as
    on the estimated view; two replicas that share nothing else learn from the engines what the
    other sent where (the slice's first 90 s; not a speed goal)."""
    mooncake = get_scenario("trace-mooncake")
    assert mooncake.trace is not None
    scenario = replace(mooncake, trace=replace(mooncake.trace, window_s=90.0))
    estimated, exact = run_virtual(scenario, "la-swrr", "prefix"), run_virtual(scenario, "la-swrr", EXACT)
    assert exact.affinity == EXACT and exact.requests == estimated.requests
    assert exact.prefix_hit_rate >= estimated.prefix_hit_rate
    assert exact.kv_events is not None and exact.kv_events["messages"] > len(scenario.engines)  # more than the first ones
    assert estimated.kv_events is None and "kv_events" not in estimated.as_dict()
    two_estimated = run_virtual(scenario, "la-swrr", "prefix", proxies=2)
    two_exact = run_virtual(scenario, "la-swrr", EXACT, proxies=2)
    assert two_exact.prefix_hit_rate > two_estimated.prefix_hit_rate
    assert two_exact.kept_on_node is not None and two_estimated.kept_on_node is not None
    assert two_exact.kept_on_node > two_estimated.kept_on_node


def test_continuations_count_a_request_kept_only_where_its_prefix_went() -> None:
    seen = Continuations()
    seen.served((1, 2, 3), "a")  # the first of its conversation: continues nothing
    seen.served((1, 9), "b")  # shares one block only: not a continuation
    seen.served((1, 2, 3, 4), "a")  # continues (1, 2, 3) on its node
    seen.served((1, 2, 5), "b")  # continues (1, 2), last served on a: moved
    assert (seen.continuing, seen.kept, seen.share) == (2, 1, 0.5)


def test_rows_run_la_swrr_both_ways_and_add_the_oracle() -> None:
    assert rows_for(["la-swrr", "rr"], None) == [("la-swrr", "prefix"), ("la-swrr", "none"), ("rr", "prefix"),
                                                 (ORACLE, "-")]
    assert rows_for(["la-swrr"], "none") == [("la-swrr", "none"), (ORACLE, "-")]
    assert rows_for(["la-swrr", "rr"], None, kv_events=True) == [
        ("la-swrr", "prefix"), ("la-swrr", EXACT), ("la-swrr", "none"), ("rr", "prefix"), (ORACLE, "-")]
    assert rows_for(["la-swrr"], "prefix", kv_events=True) == [("la-swrr", "prefix"), ("la-swrr", EXACT), (ORACLE, "-")]


def test_first_token_eta_counts_the_queue_and_the_cached_prefix() -> None:
    engine = EngineSim(get_profile("910B"), 4, speed=1.0)
    alone = engine.first_token_eta(4000, "a" * 16000, now=0.0)
    # frontend, one decode step of a batch of one, 4000 tokens of prefill at 4000 tokens/s
    assert abs(alone - (0.15 + 0.032 + 1.0)) < 1e-9
    engine.submit(4000, 10, 0.0, prompt_text="b" * 16000)
    assert engine.first_token_eta(4000, "a" * 16000, now=0.0) > alone + 0.9  # the waiting prompt first


def test_the_command_writes_its_rows_and_refuses_what_virtual_time_does_not_model(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "laswrr", "bench", "--virtual", "--out", str(tmp_path)]
    done = subprocess.run([*run, "--scenario", "smoke-trace", "--policies", "la-swrr"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "oracle" in done.stdout and "virtual time" in done.stdout
    rows = json.loads((tmp_path / "smoke-trace" / "virtual.json").read_text())
    assert [(r["policy"], r["affinity"]) for r in rows] == [("la-swrr", "prefix"), ("la-swrr", "none"), (ORACLE, "-")]
    refused = subprocess.run([*run, "--scenario", "crash-return"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--virtual models the actions" in refused.stderr
    refused = subprocess.run([*run, "--scenario", "smoke-trace", "--policies", "la-swrr+no-status"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "its weights are fixed" in refused.stderr


def test_the_command_adds_the_exact_row_with_kv_events(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "laswrr", "bench", "--out", str(tmp_path), "--scenario", "smoke-trace",
           "--policies", "la-swrr", "--affinity", "prefix", "--kv-events"]
    done = subprocess.run([*run, "--virtual"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "KV events (la-swrr/exact" in done.stdout
    rows = json.loads((tmp_path / "smoke-trace" / "virtual.json").read_text())
    assert [(r["policy"], r["affinity"], "kv_events" in r) for r in rows] == [
        ("la-swrr", "prefix", False), ("la-swrr", EXACT, True), (ORACLE, "-", False)]
    refused = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "add --virtual" in refused.stderr


def test_the_virtual_channel_delivers_a_message_the_delay_after_it_was_sent() -> None:
    scenario = get_scenario("smoke-trace")
    routers = [Router("la-swrr", k, proxy_id=f"proxy-{k}", share=True) for k in range(2)]
    for router in routers:
        router.table.offer(_snapshot(scenario), now=0.0)
    due: list[tuple[float, Callable[[float], None]]] = []
    channel = VirtualChannel(routers, delay_s=0.001, schedule=lambda at, deliver: due.append((at, deliver)))
    channel.start(0.0)
    assert not routers[1].table.route(DEFAULT_POOL).peers  # sent, not taken yet
    assert [at for at, _ in due] == [0.001, 0.001]
    for at, deliver in due:
        deliver(at)
    assert set(routers[1].table.route(DEFAULT_POOL).peers) == {"proxy-0"}
    assert routers[1].table.route(DEFAULT_POOL).peers["proxy-0"].received_at == 0.001
    try:
        VirtualChannel(routers, delay_s=0.001)
    except ValueError as exc:
        assert "schedule" in str(exc)
    else:
        raise AssertionError("a delay without a schedule was taken")


def test_replicas_that_hear_each_other_late_herd_a_burst_unless_they_pick_in_turn() -> None:
    """The Mooncake slice's arrivals share stamps (bench/trace.py): replicas that take one burst
    between them and hear each other 2 ms late all pick before they hear the others' picks, and
    send the 910C more than one proxy does, with a worse TTFT tail; picking in turn
    (``Router.stagger_s``, on by default) brings both back (the whole slice: its first 90 s show
    no difference)."""
    scenario = get_scenario("trace-mooncake")
    one = run_virtual(scenario, "la-swrr", "prefix")
    herd = run_virtual(scenario, "la-swrr", "prefix", proxies=4, peer_interval_ms=20, peer_delay_ms=2,
                       peer_stagger_ms=0)
    turns = run_virtual(scenario, "la-swrr", "prefix", proxies=4, peer_interval_ms=20, peer_delay_ms=2)
    assert herd.requests == turns.requests == one.requests
    assert herd.per_node["c1"] > one.per_node["c1"] + 20 and herd.ttft_s["p99"] > 1.3 * one.ttft_s["p99"]
    assert abs(turns.per_node["c1"] - one.per_node["c1"]) < 10 and turns.ttft_s["p99"] < 1.1 * one.ttft_s["p99"]


def test_the_channel_traffic_is_told_by_what_each_message_said() -> None:
    """``peers.json``'s ``by_kind``: every message counted once, as a pick, a release, a first
    byte or a whole view; every request's pick told, and the kinds add up to the whole."""
    traffic = PeerTraffic()
    result = run_virtual(get_scenario("smoke-trace"), "la-swrr", "prefix", proxies=2, peer_interval_ms=20,
                         traffic=traffic)
    counted = traffic.as_dict()
    kinds = counted["by_kind"]
    assert {"whole", "pick", "release", "first_byte"} <= set(kinds)
    assert sum(k["messages"] for k in kinds.values()) == counted["messages"]
    assert sum(k["wire_bytes_per_request"] for k in kinds.values()) == pytest.approx(
        counted["wire_bytes_per_request"], abs=0.5)
    assert traffic.requests == result.requests
    assert kinds["pick"]["messages"] <= result.requests  # picks of one turn go out together
    assert kinds["pick"]["messages"] + kinds["release"]["messages"] > result.requests


def test_the_picks_of_a_window_go_in_one_message_and_route_the_same() -> None:
    """``--peer-pick-ms`` (1 ms, the proxy's default): a replica tells its picks 1 ms after the
    first of them, all in one message. smoke-trace's arrivals come in bursts that share a stamp:
    with the window its 38 picks take a handful of messages instead of one each, and, the peers
    still hearing every pick before their own turn to pick, every request goes where it went."""
    scenario = get_scenario("smoke-trace")
    runs, picks = [], []
    for window_ms in (0, 1):
        traffic = PeerTraffic()
        runs.append(run_virtual(scenario, "la-swrr", "prefix", proxies=2, peer_interval_ms=20, traffic=traffic,
                                peer_pick_ms=window_ms))
        picks.append(traffic.as_dict()["by_kind"]["pick"]["messages"])
    at_once, windowed = runs
    assert windowed.per_node == at_once.per_node and windowed.ttft_s == at_once.ttft_s
    assert picks[0] >= 0.7 * at_once.requests and picks[1] <= picks[0] / 3, picks


def test_fleet_copies_the_pool_and_the_trace() -> None:
    """``--fleet K``: K times the engines and the requests, copy j's nodes named ``<node>-j``, its
    prefix blocks its own and its arrivals j / K of the mean gap between stamps later."""
    scenario = get_scenario("smoke-trace")
    assert scenario.trace is not None
    twice = fleet(scenario, 2)
    assert [e.node for e in twice.engines] == ["n1", "n2", "n1-1", "n2-1"]
    requests = load_workload(scenario.trace)
    copies = fleet_requests(requests, 2)
    assert len(copies) == 2 * len(requests) and sorted(r.index for r in copies) == list(range(len(copies)))
    assert [r.offset_s for r in copies] == sorted(r.offset_s for r in copies)
    stamps = sorted({r.offset_s for r in requests})
    gap = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    first, second = (next(r for r in copies if r.index == i) for i in (0, len(requests)))
    assert second.offset_s == pytest.approx(first.offset_s + gap / 2) and second.prompt_tokens == first.prompt_tokens
    assert not set(first.block_ids) & set(second.block_ids) and first.block_ids == requests[0].block_ids
    run = run_virtual(scenario, "la-swrr", "prefix", copies=2)
    assert run.requests == len(copies) and set(run.per_node) == {"n1", "n2", "n1-1", "n2-1"}
    assert all(count > 0 for count in run.per_node.values())
    with pytest.raises(ValueError, match="--fleet"):
        fleet(scenario, 0)


def test_kind_of_reads_a_message_by_its_changes() -> None:
    whole = PeerState(boot_id="b", seq=1, ts_ns=1, inflight={"n1": 2})
    assert kind_of(whole) == "whole"
    assert kind_of(PeerDelta(seq=2, ts_ns=2, inflight={"n1": 1, "n2": -1})) == "pick"
    assert kind_of(PeerDelta(seq=2, ts_ns=2, inflight={"n2": -1}, backlog={"n2": -300})) == "release"
    assert kind_of(PeerDelta(seq=2, ts_ns=2, backlog={"n2": -300})) == "first_byte"
    assert kind_of(PeerDelta(seq=2, ts_ns=2)) == "other"
