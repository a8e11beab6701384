"""The data dir's disk fills under the whole stack (`laswrr up`), where the recorder's DuckDB
file and the embedded nats-server's JetStream store share it: clients are served throughout,
`laswrr up` says what happened (on its own stderr: the log files are on that disk), and once
space is freed it restarts nats-server (a stream that failed a write stores nothing more until
then); the proxies send the events they held, the recorder records on, and the log has every
message of the streams once, no hole, no duplicate, no request cut; replay exact. A second run
gives the proxy an event buffer of 100 events: it drops events while JetStream cannot store,
counts them, and the requests missing from the log are what its counter says, none read as cut.

Real parts: a tmpfs mounted for the test (root only; skipped otherwise) as the data dir,
`laswrr up` as a child process with its embedded nats-server and simulated engines (speed 20),
eight streaming clients through the proxy. The tmpfs is mounted large and shrunk once the stack
runs (a cluster's three stores: just before the fill) (``mount -o remount,size=``): nats-server
checks the streams' reservations (8 GiB each) against 75% of the free space at its start and
would not start on a small disk; so the disk is small only when it fills, as a disk that had
room at start and was filled later.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import nats
import nats.js.errors
import pytest

from laswrr.replay import store
from laswrr.schemas import subjects as sj
from laswrr.services.natsbus import connect, wait_jetstream
from laswrr.services.nats_server import EmbeddedNats, NatsCluster
from tests.faults.test_full_disk import fill, tmpfs
from tests.up_process import Load, LogAudit, UpStderr, audit_log, interrupt, no_leftover_stack, start_up

no_leftover_stack = pytest.fixture(autouse=True)(no_leftover_stack)
pytestmark = pytest.mark.timeout(240)
SMALL = "96m"  # the disk once a one-server stack runs: room for the stack, and 64 MB free again after the fill
ROOM = 80 << 20  # a cluster's (three stores): what it uses just before the fill and this much more


@pytest.fixture
def big_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs mounted 32 GB (it takes memory only as it is written), to be shrunk."""
    with tmpfs(tmp_path, "32g") as mount:
        yield mount


async def health(http: aiohttp.ClientSession, proxy: str) -> dict[str, Any]:
    async with http.get(f"{proxy}/healthz") as response:
        return dict(await response.json(content_type=None))


@dataclass
class Run:
    """What one run measured (``full_disk_under_up``)."""

    load: Load
    final: dict[str, Any]  # the proxy's /healthz at the end
    audit: LogAudit
    requests: dict[str, int]  # what the log's views count
    figures: str


async def full_disk_under_up(big_disk: Path, eventually, *up_args: str, servers: int = 1) -> Run:  # type: ignore[no-untyped-def]
    """`laswrr up` on ``big_disk`` shrunk to SMALL (a cluster: to what it uses + ROOM just before
    the fill), streaming clients; fill the disk until JetStream stops storing and 300 more
    requests were served, free it, wait until the ``servers`` nats-servers are restarted, the
    proxy's events sent, 100 more requests served; stop and audit."""
    data = big_disk / "data"
    proc, banner = await start_up("--data-dir", str(data), "--proxy-port", "0", "--dashboard-port", "0",
                                  "--sim-speed", "20", *up_args)
    stderr = UpStderr(proc)
    small = SMALL
    if servers == 1:
        subprocess.run(["mount", "-o", f"remount,size={small}", str(big_disk)], check=True)
    proxy = banner["proxy URL"].split()[0]
    load = Load(proxy, stream=True, max_tokens=64)
    load.start()
    http = aiohttp.ClientSession()
    filler = big_disk / "filler"
    try:
        await eventually(lambda: load.served >= 50, 60, "the load to run")
        if servers > 1:
            small = f"{(shutil.disk_usage(big_disk).used + ROOM) >> 20}m"
            subprocess.run(["mount", "-o", f"remount,size={small}", str(big_disk)], check=True)
        filled = fill(filler)
        at_fill, full_at = load.served, time.monotonic()
        await stderr.wait_for(r"ERROR laswrr\.up: the disk of .* MB free", timeout_s=30)
        stuck = await stderr.wait_for(r"ERROR laswrr\.up: JetStream stopped storing \((.*?)\)", timeout_s=30)
        await eventually(lambda: load.served >= at_fill + 300, 60, "requests served on a full disk")
        report = await health(http, proxy)
        held, routed_on = report["events_buffered"], report["pools"]["default"]["as_of_seq"]
        served_full = load.served - at_fill
        filler.unlink()
        freed_at = time.monotonic()
        for _ in range(servers):
            await stderr.wait_for(r"restarted nats-server \(pid \d+, was \d+\)", timeout_s=60)
        restarted_s = time.monotonic() - freed_at
        await eventually(lambda: caught_up(http, proxy, routed_on), 60, "the proxy's events sent and a new snapshot")
        recovered_s = time.monotonic() - freed_at
        at_recovery = load.served
        await eventually(lambda: load.served >= at_recovery + 100, 60, "requests served after")
        assert proc.returncode is None
    finally:
        await load.stop()
        final = await health(http, proxy)
        await http.close()
        filler.unlink(missing_ok=True)
    await interrupt(proc)
    assert proc.returncode == 0, stderr.text()[-3000:]
    audit = await audit_stopped(data, servers)
    with store.open_read(data / store.DB_FILE) as con:
        requests = dict(zip(REQUEST_COUNTS, con.execute(f"SELECT {', '.join(REQUEST_COUNTS.values())}").fetchone()))
    said = [line.split(" laswrr.up: ", 1)[1].strip() for line in stderr.lines
            if "laswrr.up: the disk" in line or "JetStream" in line or "nats-server" in line]
    recorder_log = (data / "logs" / "recorder.log").read_text(errors="replace")
    refused = recorder_log.count("cannot write to")
    if refused:  # the recorder's own lines (on the full disk: those of the full time may be lost)
        assert "again after" in recorder_log
    figures = (f"({small} tmpfs, filler {filled} B, {' '.join(up_args) or 'defaults'}): served {served_full} "
               f"requests while the disk was full (JetStream: {stuck.group(1)[:60]}...), {held} events held by the "
               f"proxy then; nats-server restarted {restarted_s:.2f} s after the space was freed, proxy events sent "
               f"and snapshot fresh after {recovered_s:.2f} s; recorder commits refused: {refused} (its log); "
               f"totals: served {load.served} failed {load.failed} (cut {load.cut}, first reasons {load.reasons}), "
               f"proxy events dropped {final['events_dropped']}; the log's requests {requests}; {audit.line()}; "
               f"full for {freed_at - full_at:.1f} s\n  laswrr up said:\n    " + "\n    ".join(said))
    return Run(load, final, audit, requests, figures)


REQUEST_COUNTS = {  # what an analyst counts in the log (replay/views.sql)
    "requests": "(SELECT count(*) FROM requests)",
    "completed": "(SELECT count(*) FROM requests WHERE outcome = 'completed')",
    "open": "(SELECT count(*) FROM requests WHERE outcome IS NULL)",
    "finish_lost": "(SELECT count(*) FROM voided_requests WHERE cause = 'finish_lost')",
    "interrupted": "(SELECT count(*) FROM interruptions)",
    "finished_without_start": "(SELECT count(*) FROM input_events f WHERE family = 'lb.req.finished' AND NOT "
                              "EXISTS (SELECT 1 FROM attempts a WHERE a.attempt_id = f.j->>'request_id'))",
    "request_events": "(SELECT count(*) FROM input_events WHERE family IN ('lb.req.started', 'lb.req.finished'))",
}


async def test_a_full_data_dir_under_up_serves_on_and_loses_nothing(big_disk: Path, eventually) -> None:  # type: ignore[no-untyped-def]
    run = await full_disk_under_up(big_disk, eventually)
    print(f"FAULT full data dir under up {run.figures}")
    assert run.load.failed == 0, run.load.reasons
    assert run.final["events_dropped"] == 0
    assert run.requests["requests"] == run.requests["completed"] == run.load.served  # each client request, whole
    run.audit.assert_whole()


async def test_a_full_data_dir_under_a_cluster_of_three_restarts_each_server(big_disk: Path, eventually) -> None:  # type: ignore[no-untyped-def]
    """`--nats-cluster 3`: the three stores share the data dir's disk, so all three stop storing
    at once; `up` restarts each, one at a time, once there is room, and nothing is lost."""
    run = await full_disk_under_up(big_disk, eventually, "--nats-cluster", "3", servers=3)
    print(f"FAULT full data dir under up --nats-cluster 3 {run.figures}")
    assert run.load.failed == 0, run.load.reasons
    assert run.final["events_dropped"] == 0
    assert run.requests["requests"] == run.requests["completed"] == run.load.served
    run.audit.assert_whole()


async def test_events_a_proxy_drops_while_jetstream_cannot_store_are_counted(big_disk: Path, eventually) -> None:  # type: ignore[no-untyped-def]
    run = await full_disk_under_up(big_disk, eventually, "--proxy-arg", "event_buffer=100")
    print(f"FAULT full data dir under up, proxy event buffer 100 {run.figures}")
    assert run.load.failed == 0, run.load.reasons
    run.audit.assert_whole()  # the log holds what the streams hold, and nothing reads as cut
    dropped, counts = run.final["events_dropped"], run.requests
    assert dropped > 0 and counts["requests"] < run.load.served  # requests missing from the log...
    assert 2 * run.load.served - counts["request_events"] <= dropped  # ...as many events as the proxy counted


async def caught_up(http: aiohttp.ClientSession, proxy: str, routed_on: int) -> bool:
    """The proxy sent what it held and routes on a snapshot the scheduler made since."""
    report = await health(http, proxy)
    return bool(report["status"] == "ok" and report["events_buffered"] < 20
                and report["pools"]["default"]["as_of_seq"] > routed_on)


async def audit_stopped(data: Path, servers: int = 1) -> LogAudit:
    """The log's audit (tests/up_process.py) against the streams of the stopped stack, read from
    its JetStream store by nats-servers of the test's own (a cluster's: a cluster of as many on
    the same stores; the log is not a stream of it)."""
    logs = data.parent / "audit-logs"
    logs.mkdir(exist_ok=True)
    with NatsCluster(data, servers, log_dir=logs) if servers > 1 else EmbeddedNats(data, log_file=str(logs / "nats.log")) as server:
        nc = await connect(server.url, "audit")
        await wait_jetstream(nc)
        deadline = time.monotonic() + 30
        for stream in (sj.EVENTS_STREAM, sj.OUT_STREAM):  # a cluster's streams answer once each has a leader
            while True:
                try:
                    await nc.jetstream(timeout=2).stream_info(stream)
                    break
                except (nats.errors.TimeoutError, nats.js.errors.APIError):
                    assert time.monotonic() < deadline, f"{stream} has no leader in the audit's cluster"
                    await asyncio.sleep(0.2)
        return await audit_log(nc, data / store.DB_FILE)
