"""A live scheduler service and recorder on a real nats-server, for the tests that record a log
and then replay it (``async with live_recording(nats_url, data_dir) as live: ...``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from nats.js import JetStreamContext

from laswrr.schemas import subjects as sj
from laswrr.services.natsbus import connect, ensure_streams
from laswrr.services.recorder import Recorder, RecorderOptions
from laswrr.services.scheduler_service import SchedulerOptions, SchedulerService

from tests.conftest import wait_until


@dataclass
class LiveRecording:
    js: JetStreamContext  # a test client's, for publishing inputs
    service: SchedulerService
    recorder: Recorder

    async def settle(self, last: int, timeout_s: float = 10.0) -> None:
        """Wait until input ``last`` is applied and the recorder holds it and every output so far."""
        await wait_until(lambda: self.service.applied_seq >= last, timeout_s, "the scheduler applying the inputs")
        out_last = (await self.js.stream_info(sj.OUT_STREAM)).state.last_seq
        await wait_until(lambda: self.recorder.recorded_through[sj.EVENTS_STREAM] >= last
                         and self.recorder.recorded_through[sj.OUT_STREAM] >= out_last, timeout_s, "the recorder")


@asynccontextmanager
async def live_recording(nats_url: str, data_dir: Path) -> AsyncIterator[LiveRecording]:
    """Scheduler (no ticks of its own) and recorder (into ``data_dir``), stopped on exit."""
    client, scheduler_nc, recorder_nc = [await connect(nats_url, name) for name in ("test", "sched", "rec")]
    js = client.jetstream()
    await ensure_streams(js)
    service = SchedulerService(scheduler_nc, SchedulerOptions(tick_ms=0, fetch_timeout_s=0.05))
    recorder = Recorder(recorder_nc, RecorderOptions(data_dir=data_dir, flush_ms=20))
    stop = asyncio.Event()
    tasks = [asyncio.create_task(service.run(stop)), asyncio.create_task(recorder.run(stop))]
    await asyncio.wait_for(asyncio.gather(service.ready.wait(), recorder.ready.wait()), 10)
    try:
        yield LiveRecording(js, service, recorder)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        for nc in (client, scheduler_nc, recorder_nc):
            await nc.close()
