"""A dead proxy's cuts in the report (docs/analysts.md), with real processes: a proxy killed (-9, by
its pid) with streams open and restarted by `laswrr up` under the same id. While the stack still
runs, `laswrr report` (with the read-only viewer's credentials) counts those streams as
interruptions (`proxy_gone`, from the scheduler's recorded `lb.out.voided.proxy`), not as open, and
never says "zero interruptions"; the replay of the log reproduces the void byte for byte."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from laswrr.schemas import subjects as sj
from laswrr.services.natsbus import connect
from tests.faults.test_proxy_restart import long_stream, scheduler_inflight
from tests.replay_cli import replay_exact
from tests.up_process import UpStderr, no_leftover_stack, start_up

no_leftover_stack = pytest.fixture(autouse=True)(no_leftover_stack)
pytestmark = pytest.mark.timeout(300)
STREAMS = 6


async def all_in_flight(kv) -> bool:  # type: ignore[no-untyped-def]
    return await scheduler_inflight(kv) >= STREAMS


def report(data: Path, url: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-m", "laswrr", "report", "--db", str(data / "events.duckdb"), "--json",
                           "--nats-url", url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


async def test_a_killed_proxys_open_streams_are_counted_as_interrupted_while_the_stack_runs(
        tmp_path: Path, eventually: Callable[..., Awaitable[Any]]) -> None:
    data = tmp_path / "data"
    proc, banner = await start_up("--data-dir", str(data), "--proxy-port", "0", "--dashboard-port", "0",
                                  "--sim-speed", "0.5")
    stderr = UpStderr(proc)
    url = banner["proxy URL"].split()[0]
    viewer = (data / "secrets" / "viewer.env").read_text().strip().removeprefix("NATS_URL=")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        streams = [asyncio.create_task(long_stream(http, url)) for _ in range(STREAMS)]
        nc = await connect(viewer, "fault-test")
        try:  # every stream under way (4000 tokens at half speed: minutes), as the scheduler counts them
            kv = await nc.jetstream().key_value(sj.WEIGHTS_BUCKET)
            await eventually(lambda: all_in_flight(kv), timeout=60, what=f"the {STREAMS} streams in flight")
        finally:
            await nc.close()
        assert not any(s.done() for s in streams)
        killed_at = time.monotonic()
        os.kill(int(banner["pid proxy"]), signal.SIGKILL)
        await stderr.wait_for(r"started proxy \(pid (\d+)\)", count=2, timeout_s=60)
        outcomes = await asyncio.gather(*streams)
    assert all(o != "completed" for o in outcomes), outcomes  # every client saw its stream cut
    deadline = time.monotonic() + 60
    while True:  # the new process's first heartbeat voids the old one's requests; the recorder commits in batches
        facts = report(data, viewer)
        if facts["interrupted_proxy_gone"] >= STREAMS or time.monotonic() > deadline:
            break
        await asyncio.sleep(1)
    counted_s = time.monotonic() - killed_at
    print(f"proxy kill -9 with {STREAMS} streams open: report (live stack, viewer) counts "
          f"{facts['interrupted_proxy_gone']} proxy_gone after {counted_s:.1f} s; open {facts['open']}; "
          f"verdict {facts['verdict']}")
    assert proc.returncode is None  # the stack still runs: no clean end helps the verdict
    assert facts["interrupted_proxy_gone"] == STREAMS and facts["cut_by_router"] >= STREAMS
    assert facts["verdict"] == "interruptions_found" and not facts["zero_interruptions"]
    proc.send_signal(signal.SIGINT)
    await asyncio.wait_for(proc.wait(), 90)
    after = report(data, viewer)  # after the clean stop: the same streams, counted once
    assert after["interrupted_proxy_gone"] == STREAMS and after["interrupted"] == facts["interrupted"], after
    replay_exact(data / "events.duckdb")  # asserts identical
