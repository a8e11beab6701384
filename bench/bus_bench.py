"""Scheduler-service throughput on a real nats-server: events/s applied, published and acked.

  python -m laswrr.bench.bus_bench [--events 100000] [--batch 1000] [--mode backlog|live|both]

Workload: four registered nodes, then a request-shaped mix as the proxies and collectors produce
it (per 100 events: 45 ``lb.req.started`` + 45 ``lb.req.finished``, 8 engine samples, 1 health
probe, 1 tick), so 1 in 100 events yields snapshot outputs, as in a running stack.

* ``backlog``: publish everything first, then start a ``SchedulerService`` in this process and
  time it from start until it has applied the last event (rebuild + catch-up speed; the service
  publishes outputs and LB_WEIGHTS entries as it goes).
* ``live``: ``laswrr scheduler`` runs as its own process while this one publishes as fast as it
  can; timed from the first publish until the last event's snapshot is in LB_WEIGHTS. The
  publisher (one Python process) may be the limit here: its own rate is printed beside.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator

from nats.js import JetStreamContext

from laswrr.schemas import subjects as sj
from laswrr.services.natsbus import connect, ensure_streams
from laswrr.services.nats_server import EmbeddedNats
from laswrr.services.scheduler_service import SchedulerOptions, SchedulerService
from laswrr.schemas.codec import decode_snapshot

NODES = ("n910c", "n910b-1", "n910b-2", "n910")


def workload(count: int) -> Iterator[tuple[str, bytes]]:
    for node, capacity in zip(NODES, (16, 8, 8, 4)):
        yield sj.admin_node(node), b'{"url": "http://127.0.0.1:1", "capacity": %d}' % capacity
    open_requests: list[tuple[str, int]] = []
    request = tick = 0
    for i in range(count - len(NODES)):
        slot = i % 100
        node = NODES[i % len(NODES)]
        if slot < 45:
            request += 1
            open_requests.append((node, request))
            yield sj.req_started(node), b'{"request_id": "r%d", "proxy": "p1"}' % request
        elif slot < 90 and open_requests:
            done_node, done = open_requests.pop(0)
            yield sj.req_finished(done_node), b'{"request_id": "r%d", "proxy": "p1", "outcome": "completed", ' \
                                              b'"ttft_ms": 80.0}' % done
        elif slot < 98:
            yield sj.metrics_engine(node), b'{"running": 3, "waiting": 1, "kv_cache_usage": 0.4, "ttft_ms": 90}'
        elif slot < 99:
            yield sj.health(node), b'{"ok": true, "latency_ms": 2.0}'
        else:
            tick += 1
            yield sj.CLOCK_TICK, b'{"tick": %d}' % tick


async def publish_all(js: JetStreamContext, count: int) -> tuple[int, float]:
    started = time.perf_counter()
    last = 0
    window: list[asyncio.Future] = []  # type: ignore[type-arg]
    for subject, payload in workload(count):
        window.append(await js.publish_async(subject, payload))
        if len(window) >= 2000:
            last = max(last, max((await asyncio.gather(*window)), key=lambda a: a.seq).seq)
            window = []
    if window:
        last = max(last, max((await asyncio.gather(*window)), key=lambda a: a.seq).seq)
    return last, time.perf_counter() - started


async def backlog(url: str, count: int, batch: int) -> dict[str, float]:
    nc = await connect(url, "bench-publisher")
    js = nc.jetstream()
    await ensure_streams(js)
    last, publish_s = await publish_all(js, count)
    service_nc = await connect(url, "bench-scheduler")
    service = SchedulerService(service_nc, SchedulerOptions(tick_ms=0, batch=batch, checkpoint_every=0))
    stop = asyncio.Event()
    started = time.perf_counter()
    task = asyncio.create_task(service.run(stop))
    while service.applied_seq < last:
        await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - started
    stop.set()
    await task
    await service_nc.close()
    await nc.close()
    return {"events": last, "seconds": round(elapsed, 3), "events_per_s": round(last / elapsed),
            "outputs": service.stats.published, "publisher_events_per_s": round(last / publish_s)}


async def live(url: str, count: int, batch: int) -> dict[str, float]:
    nc = await connect(url, "bench-publisher")
    js = nc.jetstream()
    await ensure_streams(js)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "laswrr", "scheduler", "--nats-url", url, "--tick-ms", "0",
        "--batch", str(batch), "--checkpoint-every", "0", stderr=asyncio.subprocess.DEVNULL)
    await asyncio.sleep(2.0)  # let it start and go live on the empty stream
    kv = await js.key_value(sj.WEIGHTS_BUCKET)
    started = time.perf_counter()
    last, publish_s = await publish_all(js, count)
    final = (await js.publish(sj.CLOCK_TICK, b'{"tick": 999999999}')).seq
    published_at = time.perf_counter()
    while True:
        try:
            if decode_snapshot((await kv.get("default")).value or b"").as_of_seq >= final:
                break
        except Exception:
            pass
        await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - started
    proc.terminate()
    await proc.wait()
    await nc.close()
    lag_ms = (time.perf_counter() - published_at) * 1000  # last event published -> its snapshot in KV
    return {"events": final, "seconds": round(elapsed, 3), "events_per_s": round(final / elapsed),
            "publisher_events_per_s": round(last / publish_s), "lag_after_last_publish_ms": round(lag_ms, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(prog="bus_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--mode", choices=["backlog", "live", "both"], default="both")
    args = parser.parse_args()
    results = {}
    for mode in (["backlog", "live"] if args.mode == "both" else [args.mode]):
        with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(tmp) as server:
            run = backlog if mode == "backlog" else live
            results[mode] = asyncio.run(run(server.url, args.events, args.batch))
        print(f"{mode:8s} {results[mode]['events']:>8} events in {results[mode]['seconds']:6.2f} s: "
              f"{results[mode]['events_per_s']:>7} events/s (publisher alone: "
              f"{results[mode]['publisher_events_per_s']} events/s)"
              + (f"; lag after the last publish {results[mode]['lag_after_last_publish_ms']} ms" if mode == "live" else ""),
              flush=True)
    print(json.dumps({"bench": "scheduler-service", "cpus": os.cpu_count(), **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
