"""`laswrr bench --virtual --proxies N` on timeline scenarios: replicas with their own routers and
request events under the scheduler's core, the channel between them, and the overshoot after a
capacity cut (bench/virtual_timeline.py; pure, fast)."""

from __future__ import annotations

import json
from pathlib import Path

from laswrr.bench.metrics import ClientOutcome, RequestResult
from laswrr.bench.scenarios import get_scenario
from laswrr.bench.virtual_timeline import bench_timeline, overshoot, run_timeline, timeline_requests


def result(index: int, start_s: float, node: str) -> RequestResult:
    return RequestResult(index=index, start_s=start_s, end_s=start_s + 1, ttft_s=0.1, e2e_s=1.0, node=node,
                         outcome=ClientOutcome.COMPLETED, tokens=0, max_tokens=8)


def test_overshoot_counts_what_went_to_the_cut_node_beyond_its_new_share_in_the_first_second() -> None:
    scenario = get_scenario("smoke")  # n1 4 slots, n2 announced 4 -> 1 at 1 s (share 1/5), back at 2 s
    results = [result(0, 0.5, "n2"), result(1, 1.0, "n2"), result(2, 1.2, "n2"), result(3, 1.5, "n1"),
               result(4, 1.7, "n1"), result(5, 1.99, "n1"), result(6, 2.0, "n2")]
    (cut,) = overshoot(scenario, results)  # the way back up is no cut
    assert (cut["node"], cut["capacity"], cut["share"], cut["total"], cut["sent"]) == ("n2", 1, 0.2, 5, 2)
    assert (cut["expected"], cut["overshoot"]) == (1.0, 1.0)
    assert overshoot(scenario, [result(0, 1.5, "n1")])[0]["overshoot"] == 0.0


def test_a_timeline_with_replicas_runs_its_oracle_row_too(tmp_path: Path) -> None:
    """``laswrr bench --virtual --scenario <timeline> --proxies N``: the oracle row has no replicas
    (it reads the engines), so nothing waits for a replica's turn there (it raised IndexError)."""
    bench_timeline(get_scenario("smoke"), ["la-swrr"], None, 1, tmp_path, proxies=2, peer_interval_ms=20)
    document = json.loads((tmp_path / "smoke" / "virtual.json").read_text())
    assert [row["policy"] for row in document["policies"]] == ["la-swrr", "oracle"]
    assert document["proxies"] == 2 and document["peer_pick_ms"] == 1


def test_replicas_split_the_requests_and_the_channel_carries_their_picks() -> None:
    scenario = get_scenario("smoke")
    requests = timeline_requests(scenario, 1)
    one = run_timeline(scenario, "la-swrr", 1, requests)
    assert run_timeline(scenario, "la-swrr", 1, requests, proxies=1, peer_interval_ms=20).phases == one.phases
    for proxies, interval in ((2, 0), (4, 20)):
        run = run_timeline(scenario, "la-swrr", 1, requests, proxies=proxies, peer_interval_ms=interval)
        assert run.requests == len(requests) == sum(run.per_node.values())
        assert {r.outcome for r in run.detail} <= {ClientOutcome.COMPLETED, ClientOutcome.CLIENT_CANCELLED}
