"""End-to-end smoke: the tiny scenario on the real stack (NATS, scheduler, recorder, collector,
proxy, two simulated engines as child processes), two policies on the identical workload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from laswrr.bench.cli import bench_scenario
from laswrr.bench.scenarios import SMOKE
from laswrr.bench.workload import generate

pytestmark = pytest.mark.timeout(120)


async def test_smoke_two_policies_same_workload(tmp_path: Path) -> None:
    summary, paths = await bench_scenario(SMOKE, ["la-swrr", "rr"], seed=3, out_dir=tmp_path, plots=True)
    expected = generate(SMOKE.workload_spec(), 3, [(p.start_s, p.end_s) for p in SMOKE.phases])
    assert json.loads((tmp_path / "results.json").read_text())["scenario"] == "smoke"
    for policy in ("la-swrr", "rr"):
        s = summary["policies"][policy]
        lines = (tmp_path / "runs" / policy / "requests.jsonl").read_text().splitlines()
        assert [json.loads(line)["index"] for line in lines] == [r.index for r in expected]
        assert s["overall"]["requests"] == len(expected)
        assert s["overall"]["completed"] + s["overall"]["client_cancelled"] == len(expected), s["overall"]
        assert s["interrupted"] == 0 and s["errors"] == 0
        assert set(s["requests_per_node"]) == {"n1", "n2"}  # served through the proxy, node header seen
        assert len(s["notes"]) == 2  # both actions applied
        # the analyst report on the recorded log counts what the clients saw, and replay is exact
        report = s["report"]
        assert (report["completed"], report["client_cancelled"], report["interrupted"]) == (
            s["overall"]["completed"], s["overall"]["client_cancelled"], 0)
        assert report["admitted_to_draining"] == 0 and s["replay"]["ok"], s["replay"]
    # the weights the scheduler published show the announced drop of n2 (4 -> 1) and its return
    assert len(paths) == 4 and all(p.exists() for p in paths)
    snapshots = [json.loads(x) for x in (tmp_path / "runs" / "la-swrr" / "snapshots.jsonl").read_text().splitlines()]
    n2 = [(s["t_s"], s["nodes"]["n2"]["effective_weight"]) for s in snapshots if "n2" in s["nodes"]]
    assert min(w for t, w in n2 if 1.0 <= t < 2.0) <= 1.0
    assert max(w for t, w in n2 if t < 1.0) >= 3.0  # full weight, minus what its load cuts


async def test_smoke_trace_replays_the_mooncake_slice(tmp_path: Path) -> None:
    from laswrr.bench.scenarios import SMOKE_TRACE

    summary, _ = await bench_scenario(SMOKE_TRACE, ["la-swrr"], seed=1, out_dir=tmp_path, plots=False)
    s = summary["policies"]["la-swrr"]
    arrivals = summary["trace_arrivals"]
    assert arrivals["requests"] == s["overall"]["requests"] == s["overall"]["completed"] > 20
    assert s["interrupted"] == 0 and s["errors"] == 0 and s["replay"]["ok"], s["replay"]
    # every prompt shares the trace's block 0, so the engines' own counters show hits
    caches = s["prefix_cache"]
    assert set(caches) == {"n1", "n2"} and sum(c["queried_tokens"] for c in caches.values()) > 0
    assert 0 < s["prefix_cache_hit_rate"] < 1
    assert summary["trace"]["path"] == "mooncake_conversation_first300s.jsonl" and summary["workload"] is None


async def test_smoke_through_two_proxy_replicas(tmp_path: Path) -> None:
    from laswrr.replay import store

    summary, _ = await bench_scenario(SMOKE, ["la-swrr"], seed=3, out_dir=tmp_path, plots=False, proxies=2)
    s = summary["policies"]["la-swrr"]
    assert summary["proxies"] == 2
    assert s["interrupted"] == 0 and s["errors"] == 0 and s["replay"]["ok"], s["replay"]
    db = tmp_path / "runs" / "la-swrr" / "data" / store.DB_FILE
    with store.open_read(db) as con:
        per_proxy = dict(con.execute("SELECT proxy, count(*) FROM attempts GROUP BY 1").fetchall())
    # the requests alternate between the replicas: each started about half of them
    assert set(per_proxy) == {"proxy", "proxy-2"}, per_proxy
    assert abs(per_proxy["proxy"] - per_proxy["proxy-2"]) <= 1 + s["overall"]["requests"] // 10, per_proxy
    # both replicas installed snapshots and said how old each was (the other replica's counts' age)
    lag = s["view_lag"]
    assert lag["snapshots"] > 0 and 0 <= lag["mean_s"] <= lag["p99_le_s"] or lag["p99_le_s"] == float("inf"), lag
    # the channel between the replicas, from their /metrics: a message per pick at least, mostly
    # changes, and its bytes against the request events' (both with subjects)
    channel = s["channel"]  # the replicas hear each other before the load: a message per pick at least
    assert channel["messages"] >= s["overall"]["requests"] and 0 < channel["whole"] < channel["messages"], channel
    assert channel["events"] >= 2 * s["overall"]["requests"] and channel["event_bytes"] > channel["bytes"] > 0, channel


async def test_smoke_through_a_proxy_with_two_workers(tmp_path: Path) -> None:
    """``laswrr bench --workers 2``: one replica of two worker processes on one port; both take
    requests, and their /metrics (on consecutive admin ports) give the channel's traffic."""
    from laswrr.replay import store

    summary, _ = await bench_scenario(SMOKE, ["la-swrr"], seed=3, out_dir=tmp_path, plots=False, workers=2)
    s = summary["policies"]["la-swrr"]
    assert summary["workers"] == 2 and summary["proxies"] == 1
    assert s["interrupted"] == 0 and s["errors"] == 0 and s["replay"]["ok"], s["replay"]
    db = tmp_path / "runs" / "la-swrr" / "data" / store.DB_FILE
    with store.open_read(db) as con:
        per_worker = dict(con.execute("SELECT proxy, count(*) FROM attempts GROUP BY 1").fetchall())
    # the kernel spreads the connections over the workers (by their addresses: most runs, not each)
    assert per_worker and set(per_worker) <= {"proxy-0", "proxy-1"}, per_worker
    channel = s["channel"]  # both workers' /metrics: their heartbeats at least
    assert channel["whole"] >= 2 and channel["event_bytes"] > channel["bytes"] > 0, channel
    assert s["view_lag"]["snapshots"] > 0


async def test_a_peer_that_will_not_start_costs_its_row_not_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from laswrr.bench import stack_adapter
    from laswrr.bench.report import print_table

    router = tmp_path / "broken-router"  # a real process that dies at start, as a peer with a bad flag does
    router.write_text("#!/bin/sh\necho 'error: unexpected argument' >&2\nexit 3\n")
    router.chmod(0o755)
    monkeypatch.setattr(stack_adapter, "peer_binary", lambda _router: str(router))
    summary, _ = await bench_scenario(SMOKE, ["sglang-router:round_robin", "la-swrr"], seed=3,
                                      out_dir=tmp_path / "out", plots=False)
    reason = summary["not_run"]["sglang-router:round_robin"]
    assert "exited with 3" in reason and "sglang-router.log" in reason, reason
    assert list(summary["policies"]) == ["la-swrr"]
    s = summary["policies"]["la-swrr"]
    assert s["overall"]["completed"] > 0 and s["interrupted"] == 0 and s["replay"]["ok"]
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["not_run"] == summary["not_run"]
    print_table(summary)
    assert "sglang-router:round_robin: did not run: sglang-router exited with 3" in capsys.readouterr().out
