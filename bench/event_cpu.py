"""CPU per request on the event bus, one message per event vs ``lb.req.batch`` batches.

    python -m laswrr.bench.event_cpu [--requests 20000] [--batches 1,20,100]

For each batch size (1: the single-event subjects ``lb.req.started/finished.<node>``; N: the
proxy's ``lb.req.batch.<proxy>`` messages of N events), on a fresh embedded nats-server: publish
the request events of ``--requests`` requests as the proxy encodes them (acks awaited together),
then let a ``SchedulerService`` and then a ``Recorder`` (each in this process) catch up with the
backlog. The figures are CPU seconds (this process's, and the nats-server's from /proc) per
request: nats-server while storing, the scheduler and nats-server while it consumes, the
recorder and nats-server while it records. CPU time, unlike a rate, hardly depends on what else
runs on the machine. The proxy's own cost is ``proxy_bench``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import tempfile
import time
from pathlib import Path

from laswrr.schemas import events as ev
from laswrr.schemas import facts
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import batch_item, batch_payload, encode
from laswrr.schemas.words import RequestOutcome
from laswrr.services.natsbus import connect, ensure_streams
from laswrr.services.nats_server import EmbeddedNats
from laswrr.services.recorder import Recorder, RecorderOptions
from laswrr.services.scheduler_service import SchedulerOptions, SchedulerService

NODES = ("n1", "n2", "n3", "n4")
BOOT = "0123456789abcdef"
OPEN = 8  # requests in flight at once


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def request_events(requests: int) -> list[tuple[str, str, bytes]]:
    """``(kind, node, payload)`` of every started and finished event, as the proxy encodes them."""
    out: list[tuple[str, str, bytes]] = []
    open_: list[tuple[str, str]] = []

    def finish(node: str, rid: str) -> None:
        out.append((ev.RequestFinished.KIND, node, encode(ev.RequestFinished(
            request_id=rid, proxy="proxy", outcome=RequestOutcome.COMPLETED, ttft_ms=81.2, duration_ms=1270.5, prompt_tokens=412,
            completion_tokens=96, status=200, ts_ns=time.time_ns(), boot_id=BOOT))))

    for r in range(requests):
        node, rid = NODES[r % len(NODES)], f"proxy-{BOOT}-{r}"
        out.append((ev.RequestStarted.KIND, node, encode(ev.RequestStarted(
            request_id=rid, proxy="proxy", snapshot_seq=5, ts_ns=time.time_ns(), boot_id=BOOT, prompt_tokens=412,
            max_tokens=96))))
        open_.append((node, rid))
        if len(open_) > OPEN:
            finish(*open_.pop(0))
    for node, rid in open_:
        finish(node, rid)
    return out


def messages(events: list[tuple[str, str, bytes]], batch: int) -> list[tuple[str, bytes]]:
    if batch == 1:
        return [(f"{facts.BY_KIND[kind].subject}.{node}", data) for kind, node, data in events]
    return [(sj.req_batch("proxy"), batch_payload(BOOT, n + 1, [batch_item(*e) for e in events[i:i + batch]]))
            for n, i in enumerate(range(0, len(events), batch))]


async def measure(requests: int, batch: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(tmp) as server:
        assert server.process is not None
        nats_pid = server.process.pid
        nc = await connect(server.url, "bench-publisher")
        js = nc.jetstream()
        await ensure_streams(js)
        for node in NODES:
            await js.publish(sj.admin_node(node), b'{"url": "http://127.0.0.1:1", "capacity": 10}')
        to_send = messages(request_events(requests), batch)
        nats_before, last, window = cpu_seconds(nats_pid), 0, []
        for subject, data in to_send:
            window.append(await js.publish_async(subject, data))
            if len(window) >= 1000:
                last = max(ack.seq for ack in await asyncio.gather(*window))
                window = []
        if window:
            last = max(ack.seq for ack in await asyncio.gather(*window))
        figures = {"nats_store": cpu_seconds(nats_pid) - nats_before}

        async def catch_up(name: str, start: object, done: object) -> None:
            nats0, own0 = cpu_seconds(nats_pid), time.process_time()
            stop = asyncio.Event()
            task = asyncio.create_task(start(stop))  # type: ignore[operator]
            while not done():  # type: ignore[operator]
                await asyncio.sleep(0.002)
            figures[name], figures[f"nats_to_{name}"] = time.process_time() - own0, cpu_seconds(nats_pid) - nats0
            stop.set()
            await task

        scheduler_nc = await connect(server.url, "bench-scheduler")
        service = SchedulerService(scheduler_nc, SchedulerOptions(tick_ms=0, checkpoint_every=0))
        await catch_up("scheduler", service.run, lambda: service.applied_seq >= last)
        await scheduler_nc.close()
        recorder_nc = await connect(server.url, "bench-recorder")
        recorder = Recorder(recorder_nc, RecorderOptions(data_dir=Path(tmp) / "recorder", flush_ms=50))
        await catch_up("recorder", recorder.run, lambda: recorder.recorded_through[sj.EVENTS_STREAM] >= last)
        await recorder_nc.close()
        await nc.close()
    per_request = {name: round(1e6 * seconds / requests, 1) for name, seconds in figures.items()}
    return {"batch": batch, "requests": requests, "messages": len(to_send), "cpu_us_per_request": per_request,
            "total_us_per_request": round(sum(per_request.values()), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m laswrr.bench.event_cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20_000, help="requests (two events each; default 20000)")
    parser.add_argument("--batches", default="1,20,100", help="batch sizes, 1 = single events (default 1,20,100)")
    args = parser.parse_args(argv)
    logging.getLogger("laswrr").setLevel(logging.ERROR)  # the services' start-up notes
    print(f"event bus CPU per request ({args.requests} requests, load average {os.getloadavg()[0]:.2f})")
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        result = asyncio.run(measure(args.requests, batch))
        results.append(result)
        cpu = " ".join(f"{k}={v:g}" for k, v in result["cpu_us_per_request"].items())  # type: ignore[union-attr]
        print(f"  batch {batch:>4}: {result['messages']:>6} messages  {result['total_us_per_request']:>6} us/request  "
              f"({cpu})", flush=True)
    print(json.dumps({"bench": "event-cpu", "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
