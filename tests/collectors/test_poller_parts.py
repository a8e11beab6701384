"""Small parts of the collector's poller: counters, rate-limited warnings, tick pacing."""

from __future__ import annotations

import asyncio
import logging

import pytest

from laswrr.collectors.poller import AsyncTicks, RateLimitedLog, Stats


def test_stats_totals_summary_and_prometheus_text() -> None:
    stats = Stats()
    for outcome in ("ok", "ok", "garbage"):
        stats.inc("scrapes", node="n1", outcome=outcome)
    stats.inc("scrapes", node="n2", outcome="ok")
    stats.inc("published", kind="engine")
    assert stats.total("scrapes") == 4 and stats.total("scrapes", outcome="ok") == 3
    assert stats.total("scrapes", node="n1", outcome="garbage") == 1
    assert stats.summary() == "scrapes {'garbage': 1, 'ok': 3}; published {'engine': 1}"
    text = stats.render().decode()
    assert 'laswrr_collector_scrapes_total{node="n1",outcome="garbage"} 1.0' in text
    assert 'laswrr_collector_published_total{kind="engine"} 1.0' in text
    assert Stats().summary() == "nothing collected"


def test_rate_limited_warnings_count_what_they_suppress(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    warn = RateLimitedLog(every_s=30.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="laswrr.collector"):
        for t in (0.0, 1.0, 2.0, 31.0):
            now[0] = t
            warn.warning("n1:metrics", "n1 down")
        warn.warning("n2:metrics", "n2 down")
        warn.resolved("n1:metrics", "n1 back")
        warn.resolved("n3:metrics", "never warned, never resolved")
    assert [r.getMessage() for r in caplog.records] == [
        "n1 down", "n1 down (2 more since the last report)", "n2 down", "n1 back"]


async def test_ticks_skip_what_an_overrun_missed() -> None:
    stop, late = asyncio.Event(), []
    ticks, count = AsyncTicks(0.05, stop, lambda: late.append(1)), 0
    async for _ in ticks:
        count += 1
        if count == 2:
            await asyncio.sleep(0.18)  # overruns ~3 periods
        if count == 4:
            stop.set()
    assert count == 4 and 2 <= len(late) <= 4
