"""An idle `laswrr up` stack stops filling the log with ticks and samples (docs/analysts.md, "Retention and partitioning").

Before, an idle stack published a tick every 100 ms (and a snapshot with it) and every engine
sample and health probe every 500 ms: ~37 events a second for nothing. Now the scheduler skips a
tick that changes nothing (a keep-alive every 5 s) and the collector an unchanged sample (a
keep-alive every 10 s). The test waits for the pool to settle, then counts, per subject, what
LB_EVENTS gained over a window: at most the keep-alives, where the old rates would be ~20 times as many.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import nats
import pytest

from laswrr.schemas import subjects as sj
from laswrr.services.up import DEFAULT_SIMS
from tests.up_process import UpStderr, finish, interrupt, no_leftover_stack, start_up

no_leftover_stack = pytest.fixture(autouse=True)(no_leftover_stack)

nodes = len(DEFAULT_SIMS)
WINDOW_S = 6.0  # longer than the tick keep-alive (5 s), shorter than the samples' (10 s)


def kind(subject: str) -> str:
    parts = subject.split(".")
    return ".".join(parts[:3] if len(parts) > 3 else parts[:2] if parts[1] == "health" else parts)


async def counts(js: nats.js.JetStreamContext) -> Counter[str]:
    info = await js.stream_info(sj.EVENTS_STREAM, subjects_filter=">")
    per_kind: Counter[str] = Counter()
    for subject, n in (info.state.subjects or {}).items():
        per_kind[kind(subject)] += n
    return per_kind


async def test_an_idle_stack_publishes_only_keepalives(tmp_path: Path) -> None:
    proc, banner = await start_up("--data-dir", str(tmp_path / "data"), "--proxy-port", "0", "--dashboard-port", "0")
    UpStderr(proc)  # keeps its stderr pipe from filling
    try:
        nc = await nats.connect(banner["operator URL"])
        js = nc.jetstream()
        # settled: a whole window with no more ticks than the keep-alive (registration, the first
        # samples and easing to the weights take a few seconds; give it a minute on a busy machine)
        deadline, gained = time.monotonic() + 90, Counter[str]()
        while time.monotonic() < deadline:
            before = await counts(js)
            await asyncio.sleep(WINDOW_S)
            gained = await counts(js) - before
            if gained[sj.CLOCK_TICK] <= 2:
                break
        await nc.close()
    finally:
        await interrupt(proc)
        await finish(proc)
    # the old rates over 6 s: 60 ticks, 12 engine samples and 12 probes per node
    assert gained[sj.CLOCK_TICK] <= 2, gained
    assert gained["lb.metrics.engine"] <= nodes, gained
    assert gained["lb.health"] <= nodes, gained
    assert sum(gained.values()) <= 8 * nodes, gained  # and the proxy's heartbeats, the model lists
