"""One node of a three-node NATS cluster killed (-9, by its own pid) under load loses nothing.

Real parts: `laswrr up --nats-cluster 3` (three embedded nats-servers with routes on loopback,
streams and buckets with three replicas, every child given all three URLs) with its simulated
engines, and eight real clients streaming chat completions through the proxy during the kill.
The node killed is the leader of LB_EVENTS (the worst case: the stream elects a new leader);
`laswrr up` starts it again and it rejoins.

Asserted: every client stream completed (none failed, none cut by the router: the recorded
``interruptions`` view is empty); no lost events (every client request is in the log with its
started and finished events, once; each stream's recorded seqs are 1..last with no hole and no
duplicate); snapshots go on within a generous bound; the restarted node is back as a current
replica of LB_EVENTS; ``laswrr replay --db`` on the log is exact. Measured and printed: the
longest pause of snapshots after the kill, the time until the node rejoined.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import nats
import nats.js.errors
import pytest
from nats.js.api import ClusterInfo

from laswrr.replay import store
from laswrr.schemas import subjects as sj
from laswrr.services.natsbus import connect, split_urls
from tests.replay_cli import replay_exact
from tests.up_process import Load, UpStderr, no_leftover_stack, start_up

no_leftover_stack = pytest.fixture(autouse=True)(no_leftover_stack)
pytestmark = pytest.mark.timeout(240)
SNAPSHOT_BOUND_S = 30.0  # a JetStream leader election takes seconds; room for a loaded machine
REJOIN_BOUND_S = 60.0


def operator_url(data: Path) -> str:
    line = (data / "secrets" / "operator.env").read_text().strip()
    return line.partition("=")[2]


async def proxy_counter(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(f"{url}/metrics") as response:
        for line in (await response.text()).splitlines():
            if line.startswith(name + " ") or line.startswith(name + "_total "):
                return float(line.split()[-1])
    raise AssertionError(f"{name} not in the proxy's /metrics")


async def events_cluster(js) -> ClusterInfo | None:  # type: ignore[no-untyped-def]
    """LB_EVENTS's cluster: its leader and replicas; None while it elects a leader (no answer)."""
    try:
        return (await js.stream_info(sj.EVENTS_STREAM)).cluster
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.APIError):
        return None


def current_in(info: ClusterInfo | None, node: str) -> bool:
    """``node`` leads LB_EVENTS or is one of its current replicas."""
    return info is not None and (info.leader == node or any(
        p.name == node and p.current and not p.offline for p in info.replicas or []))


async def recorder_caught_up(nc, data: Path, timeout_s: float = 60.0) -> float:  # type: ignore[no-untyped-def]
    """When the recorder has recorded LB_EVENTS up to its end: it answers a copy request only then
    (its consumers, recreated after the kill, may lag while the streams elect new leaders)."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = json.dumps({"db": str((data / store.DB_FILE).resolve()),
                           "to": str(data / f"copy-{time.monotonic_ns()}.duckdb")}).encode()
        try:
            if "path" in json.loads((await nc.request(sj.RECORDER_SNAPSHOT, body, timeout=5.0)).data):
                return time.monotonic()
        except nats.errors.TimeoutError:
            pass
        assert time.monotonic() < deadline, "the recorder never caught up"


async def test_a_cluster_node_killed_under_load_loses_nothing(tmp_path: Path,
                                                              eventually: Callable[..., Awaitable[Any]]) -> None:
    data = tmp_path / "data"
    proc, banner = await start_up("--nats-cluster", "3", "--data-dir", str(data), "--proxy-port", "0",
                                  "--dashboard-port", "0", "--sim-speed", "20")
    stderr = UpStderr(proc)
    proxy = banner["proxy URL"].split()[0]
    urls = split_urls(operator_url(data))
    assert len(urls) == 3
    probe = await connect(",".join(urls), "fault-probe")
    leader = (await probe.jetstream().stream_info(sj.EVENTS_STREAM)).cluster.leader  # type: ignore[union-attr]
    await probe.close()
    victim = int(leader.rpartition("-")[2]) - 1  # nats-<i>
    assert banner[f"pid {leader}"]
    # The observer stays off the node to be killed, so what it sees is the stack's pause, not its own.
    nc = await connect(",".join(u for i, u in enumerate(urls) if i != victim), "fault-test", dont_randomize=True)
    js = nc.jetstream()
    seen: list[float] = []

    async def on_snapshot(msg) -> None:  # type: ignore[no-untyped-def]
        seen.append(time.monotonic())

    await nc.subscribe(f"{sj.OUT_SNAPSHOT}.>", cb=on_snapshot)
    load = Load(proxy, stream=True, max_tokens=24)
    load.start()
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    try:  # the load under way and the scheduler's snapshots coming, before the kill
        await eventually(lambda: load.served >= 20 and len(seen) >= 3, timeout=60, what="load served and snapshots")
        served_before = load.served
        killed_at = time.monotonic()
        os.kill(int(banner[f"pid {leader}"]), signal.SIGKILL)
        restarted = await stderr.wait_for(rf"started {leader} \(pid (\d+)\)", timeout_s=REJOIN_BOUND_S)
        restarted_s = time.monotonic() - killed_at
        rejoined_s = None
        while rejoined_s is None:
            info = await events_cluster(js)
            if current_in(info, leader):
                rejoined_s = time.monotonic() - killed_at
            else:
                assert time.monotonic() - killed_at < REJOIN_BOUND_S, f"{leader} not back in LB_EVENTS: {info}"
                await asyncio.sleep(0.1)
        while not any(t > killed_at for t in seen):  # the scheduler's consumer may come back after the node
            assert time.monotonic() - killed_at < SNAPSHOT_BOUND_S, "no snapshot after the kill"
            await asyncio.sleep(0.1)
        await asyncio.sleep(2.0)  # load goes on with the node back
        after = [t for t in seen if t > killed_at]
        pause_s = max(b - a for a, b in zip([killed_at, *after], after))
        await load.stop()
        while await proxy_counter(http, proxy, "laswrr_proxy_events_buffered") > 0:
            await asyncio.sleep(0.1)
        acked = await proxy_counter(http, proxy, "laswrr_proxy_events_published")
        last_seq = {s: (await js.stream_info(s)).state.last_seq for s in (sj.EVENTS_STREAM, sj.OUT_STREAM)}
        caught_up_s = await recorder_caught_up(nc, data) - killed_at
    finally:
        await http.close()
        if load._running:
            await load.stop()
        await nc.close()
    assert int(restarted.group(1)) != int(banner[f"pid {leader}"])
    proc.send_signal(signal.SIGINT)
    await asyncio.wait_for(proc.wait(), 90)
    assert proc.returncode == 0, stderr.text()[-3000:]
    with store.open_read(data / store.DB_FILE) as con:
        rows = {s: con.execute("SELECT count(*), count(DISTINCT seq), min(seq), max(seq) FROM events WHERE stream = ?",
                               [s]).fetchone() for s in (sj.EVENTS_STREAM, sj.OUT_STREAM)}
        requests = con.execute("SELECT count(*), count(*) FILTER (WHERE outcome = 'completed') FROM requests").fetchone()
        attempts = con.execute("SELECT count(*), count(DISTINCT attempt_id), count(finished_seq) FROM attempts").fetchone()
        req_rows = con.execute("SELECT count(*) FROM input_events WHERE family IN ('lb.req.started', 'lb.req.finished')"
                               ).fetchone()
        proxy_rows = con.execute("SELECT count(*) FROM input_events WHERE (family IN ('lb.req.started', "
                                 "'lb.req.finished') AND j->>'proxy' = 'proxy') OR (family = 'lb.proxy.heartbeat' "
                                 "AND key = 'proxy')").fetchone()
        cut = con.execute("SELECT count(*) FROM interruptions").fetchone()
    summary = replay_exact(data / store.DB_FILE)
    clients = load.served + load.failed
    print(f"FAULT nats cluster node {leader} (LB_EVENTS leader) kill -9 under {load.workers} streaming clients: "
          f"served {load.served} ({load.served - served_before} from the kill on) failed {load.failed} cut by the "
          f"router {cut[0] if cut else None} (client-side cut {load.cut}); snapshots' longest pause after the kill "
          f"{pause_s:.2f} s; node restarted after {restarted_s:.2f} s, a current LB_EVENTS replica after "
          f"{rejoined_s:.2f} s; the recorder caught up {caught_up_s:.2f} s after the kill; proxy events acked {acked:.0f}, recorded {proxy_rows[0] if proxy_rows else None} "
          f"(with those after the count); LB_EVENTS last seq {last_seq[sj.EVENTS_STREAM]} before the stop, "
          f"recorded {rows[sj.EVENTS_STREAM]}; replay: {summary}")
    assert load.failed == 0 and load.cut == 0, load.reasons
    assert cut == (0,)
    assert requests == (clients, clients)  # every client request, with its outcome, is in the log
    assert attempts is not None and attempts[0] == attempts[1] == attempts[2] and req_rows == (2 * attempts[0],)
    assert proxy_rows is not None and proxy_rows[0] >= acked
    for stream, (count, distinct, first, last) in rows.items():
        assert count == distinct == last and first == 1, (stream, rows[stream])  # 1..last: no hole, no duplicate
        assert last >= last_seq[stream]
    assert pause_s < SNAPSHOT_BOUND_S
