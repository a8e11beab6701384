"""``laswrr scheduler --metrics-port`` and ``laswrr recorder --metrics-port`` as real child
processes on a real nats-server: applied events, rejections by reason, lag, rows written."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import aiohttp
from nats.aio.client import Client

from laswrr.schemas import subjects as sj
from laswrr.services.children import ChildProcesses
from laswrr.services.nats_server import free_port
from laswrr.schemas.words import RejectCause


def value(text: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    assert match, f"{series} not in:\n{text}"
    return float(match.group(1))


async def scrape_until(url: str, check: str, timeout_s: float = 15.0, also: str | None = None) -> str:
    """The first scrape holding ``check`` and, if given, showing the series ``also`` above 0 (the
    scheduler counts a batch only after it applied the batch's events and published its outputs)."""
    deadline, text = time.monotonic() + timeout_s, ""
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url) as resp:
                    text = await resp.text()
                if check in text and (also is None or value(text, also) > 0):
                    return text
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise AssertionError(f"{check!r} not seen at {url}; last:\n{text}")


async def test_scheduler_and_recorder_export_their_progress(nats_url: str, nc: Client, tmp_path: Path) -> None:
    children = ChildProcesses(tmp_path / "logs")
    sched_port, rec_port = free_port(), free_port()
    js = nc.jetstream()
    try:
        await children.spawn("scheduler", "scheduler", "--nats-url", nats_url, "--tick-ms", "0",
                             "--metrics-port", str(sched_port), role="scheduler")
        await children.spawn("recorder", "recorder", "--nats-url", nats_url, "--data-dir", str(tmp_path),
                             "--metrics-port", str(rec_port), role="recorder")
        await js.publish(sj.admin_node("n1"), b'{"url": "http://127.0.0.1:1", "capacity": 4}')
        await js.publish(sj.admin_capacity("n9"), b'{"capacity": 1}')  # unknown node
        await js.publish(sj.admin_capacity("n8"), b'{"capacity": 2}')  # unknown node
        await js.publish(sj.admin_capacity("n1"), b"not json")
        text = await scrape_until(f"http://127.0.0.1:{sched_port}/metrics", "laswrr_scheduler_events_applied_total 4.0",
                                  also="laswrr_scheduler_batch_seconds_count")
        assert value(text, 'laswrr_scheduler_rejections_total{reason="unknown_node"}') == 2
        assert value(text, 'laswrr_scheduler_rejections_total{reason="not_json"}') == 1
        for cause in RejectCause:  # one series per cause, whatever the reasons said
            expected = {RejectCause.UNKNOWN_NODE: 2, RejectCause.NOT_JSON: 1}.get(cause, 0)
            assert value(text, f'laswrr_scheduler_rejections_total{{reason="{cause}"}}') == expected
        assert value(text, "laswrr_scheduler_lag_messages") == 0
        assert value(text, "laswrr_scheduler_applied_seq") == 4
        assert value(text, "laswrr_scheduler_checkpoint_lag_events") == 4
        assert value(text, "laswrr_scheduler_batch_seconds_count") >= 1
        assert value(text, "laswrr_scheduler_outputs_published_total") >= 5  # phase, snapshot, 3 rejections

        text = await scrape_until(f"http://127.0.0.1:{rec_port}/metrics",
                                  'laswrr_recorder_rows_written_total{stream="LB_EVENTS"} 4.0')
        assert value(text, 'laswrr_recorder_lag_messages{stream="LB_EVENTS"}') == 0
        assert value(text, 'laswrr_recorder_recorded_seq{stream="LB_EVENTS"}') == 4
        assert value(text, 'laswrr_recorder_batch_seconds_count{stream="LB_EVENTS"}') >= 1

        await children.stop(("scheduler",))  # the recorder records on its own
        for node in ("a", "b", "c"):
            await js.publish(sj.admin_capacity(node), b'{"capacity": 1}')
        text = await scrape_until(f"http://127.0.0.1:{rec_port}/metrics",
                                  'laswrr_recorder_rows_written_total{stream="LB_EVENTS"} 7.0')
    finally:
        await children.stop(("scheduler", "recorder"))


async def test_a_lagging_scheduler_shows_its_lag(nats_url: str, nc: Client, tmp_path: Path) -> None:
    js = nc.jetstream()
    for i in range(5):
        await js.publish(sj.admin_capacity(f"x{i}"), b'{"capacity": 1}')
    await asyncio.sleep(1.2)  # the lag is an age: the oldest message not applied must be over 1 s old
    from laswrr.services.service_metrics import lag

    behind, behind_s = await lag(js, sj.EVENTS_STREAM, 2)
    assert behind == 3 and 1.0 <= behind_s < 30
    assert await lag(js, sj.EVENTS_STREAM, 5) == (0, 0.0)
