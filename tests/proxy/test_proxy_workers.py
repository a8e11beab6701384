"""`laswrr proxy --workers 2` as a real process tree on a real port: both workers serve (the
scheduler counts requests of both proxy ids), a worker killed by its PID is restarted while what
the other admitted runs to its end, and SIGTERM drains both. A proxy that shares its port
(``reuse_port``, what each worker is) listens only once it holds a routing snapshot, so a worker
restarted beside serving ones takes no connection it could only answer 503 ``no_snapshot``.

Real parts: the test's nats-server, the scheduler service in-process (it folds the workers'
events into snapshots), echo engines, `python -m laswrr proxy --workers 2` as a child process;
the in-process proxy (``app.start``) for the snapshot wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from nats.js.errors import KeyNotFoundError

from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import decode_snapshot
from laswrr.services.children import preexec
from laswrr.services.proxy.app import RunningProxy, start
from laswrr.services.proxy.config import ProxyConfig
from laswrr.services.scheduler_service import SchedulerOptions, SchedulerService

from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(180)
CHAT = "/v1/chat/completions"
WORKER_LINE = re.compile(r"worker (\S+) \(pid (\d+)\) listening on")


class Parent:
    """The `laswrr proxy --workers N` process: its URL, and its workers' pids from its log."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []
        self.url = ""
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> "Parent":
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), 60)
        assert line.startswith(b"proxy listening on "), (line, self.lines)
        self.url = line.decode().split()[-1]
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.process.stderr is not None
        while line := await self.process.stderr.readline():
            self.lines.append(line.decode(errors="replace"))

    def pids(self) -> dict[str, list[int]]:
        """Each worker's pids, in start order (a restart adds one)."""
        out: dict[str, list[int]] = {}
        for line in self.lines:
            if match := WORKER_LINE.search(line):
                out.setdefault(match.group(1), []).append(int(match.group(2)))
        return out

    async def stop_reader(self) -> None:
        if self._reader is not None:
            await asyncio.wait_for(self._reader, 10)


@pytest.fixture
async def scheduler(nc: Any) -> AsyncIterator[SchedulerService]:
    service = SchedulerService(nc, SchedulerOptions(tick_ms=100, replica_id="sched-test", checkpoint_every=0))
    stop = asyncio.Event()
    runner = asyncio.create_task(service.run(stop))
    await asyncio.wait_for(service.ready.wait(), 10)
    yield service
    stop.set()
    await asyncio.wait_for(runner, 10)


@pytest.fixture
async def two_nodes(engines: Any, nc: Any, scheduler: SchedulerService) -> None:
    """Nodes a and b registered, and in the pool's snapshot (the workers listen once they hold it)."""
    js = nc.jetstream()
    for name in ("a", "b"):
        engine = await engines(name)
        await js.publish(sj.admin_node(name), json.dumps({"url": engine.url, "capacity": 64}).encode())
    kv = await js.key_value(sj.WEIGHTS_BUCKET)

    async def listed() -> bool:
        with contextlib.suppress(KeyNotFoundError):
            return len(decode_snapshot((await kv.get("default")).value or b"").nodes) == 2
        return False

    deadline = time.monotonic() + 10
    while not await listed():
        assert time.monotonic() < deadline, "nodes a and b not in the snapshot"
        await asyncio.sleep(0.05)


@pytest.fixture
async def parent(nats_url: str, two_nodes: None) -> AsyncIterator[Parent]:
    env = {**os.environ, "NATS_URL": nats_url, "PYTHONUNBUFFERED": "1"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "laswrr", "proxy", "--workers", "2", "--host", "127.0.0.1", "--port", "0",
        "--proxy-id", "wk", "--grace-s", "20", "--log-level", "info", stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, preexec_fn=preexec())
    proc = Parent(process)
    try:
        yield await proc.start()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        for pids in proc.pids().values():  # no worker outlives the test
            for pid in pids:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    continue
                os.kill(pid, signal.SIGKILL)


def split(service: SchedulerService) -> dict[str, int]:
    """Requests the scheduler holds open per proxy id (what the snapshot's proxy_inflight adds up)."""
    out: dict[str, int] = {}
    for request in service.scheduler.state.open_requests.values():
        out[request.proxy] = out.get(request.proxy, 0) + 1
    return out


async def stream(http: aiohttp.ClientSession, url: str, chunks: int, delay: float) -> str:
    body = {"model": "m", "stream": True, "messages": [], "test": {"chunks": chunks, "delay": delay}}
    try:
        async with http.post(url + CHAT, json=body) as response:
            data = await response.read()
            return "completed" if data.endswith(b"data: [DONE]\n\n") else "cut"
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return "cut"


async def open_streams_on_both(http: aiohttp.ClientSession, parent: Parent, service: SchedulerService,
                               chunks: int, delay: float) -> list[asyncio.Task[str]]:
    """Streams on fresh connections (the kernel picks a worker per connection) until both hold some."""
    tasks: list[asyncio.Task[str]] = []
    while len(split(service)) < 2:
        assert len(tasks) < 60, f"60 connections and still one worker only: {split(service)}"
        for _ in range(4):
            tasks.append(asyncio.create_task(stream(http, parent.url, chunks, delay)))
        await wait_until(lambda: sum(split(service).values()) == len(tasks), 10, "the streams counted")
    return tasks


async def test_two_workers_serve_survive_a_kill_and_drain_on_sigterm(
        scheduler: SchedulerService, parent: Parent) -> None:
    await wait_until(lambda: set(parent.pids()) == {"wk-0", "wk-1"}, 10, "both workers in the parent's log")
    connector = aiohttp.TCPConnector(force_close=True)  # one connection per request: the kernel spreads them
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
        # readiness on the shared port: wait until requests are routed (both workers hold the snapshot)
        deadline = time.monotonic() + 20
        while True:
            async with http.post(parent.url + CHAT, json={"model": "m", "messages": []}) as response:
                if response.status == 200:
                    break
            assert time.monotonic() < deadline, "no worker routes"
            await asyncio.sleep(0.1)

        # 1. both serve: the scheduler counts open requests of both proxy ids, and of no other
        tasks = await open_streams_on_both(http, parent, scheduler, chunks=120, delay=0.05)  # ~6 s each
        held = split(scheduler)
        assert set(held) == {"wk-0", "wk-1"}, held

        # 2. kill wk-0 by its pid: its own streams are cut, wk-1's all run to their end
        victim = parent.pids()["wk-0"][-1]
        os.kill(victim, signal.SIGKILL)
        outcomes = await asyncio.gather(*tasks)
        assert outcomes.count("completed") == held["wk-1"], (outcomes, held)
        assert outcomes.count("cut") == held["wk-0"], (outcomes, held)
        await wait_until(lambda: len(parent.pids()["wk-0"]) == 2, 30, "wk-0 restarted")
        assert parent.pids()["wk-0"][-1] != victim and parent.process.returncode is None

        # the restarted wk-0 is a new process to the scheduler: what the killed one left open is void
        await wait_until(lambda: not split(scheduler), 20, "no request held open after the kill")

        # 3. SIGTERM drains both: streams already admitted on either worker finish, exit 0
        tasks = await open_streams_on_both(http, parent, scheduler, chunks=40, delay=0.05)  # ~2 s each
        parent.process.send_signal(signal.SIGTERM)
        outcomes = await asyncio.gather(*tasks)
        assert outcomes == ["completed"] * len(tasks)
        assert await asyncio.wait_for(parent.process.wait(), 60) == 0
    await parent.stop_reader()
    for pids in parent.pids().values():
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    # each worker said it stopped (lb.proxy.stopped), so the scheduler holds nothing open for them
    await wait_until(lambda: not split(scheduler), 10, "the scheduler holds no request of the workers")


async def test_a_proxy_sharing_its_port_listens_once_it_routes(
        nats_url: str, engines: Any, core: Any, tap: Any, http: aiohttp.ClientSession) -> None:
    """Connected to NATS and heartbeating, but no snapshot yet: not listening; the first
    snapshot installed, it listens and serves (before, it listened at once and answered the
    connections the kernel gave it 503 no_snapshot while the other workers could serve them)."""
    config = ProxyConfig(nats_url=nats_url, host="127.0.0.1", port=0, proxy_id="late", reuse_port=True,
                         heartbeat_s=0.1)
    starting = asyncio.create_task(start(config))
    proxy: RunningProxy | None = None
    try:
        await wait_until(lambda: any(s.endswith(".late") for s, _ in tap.of(sj.PROXY_HEARTBEAT)), 10, "its heartbeat")
        assert not starting.done()  # on NATS, nothing to route on: its port is not open yet
        engine = await engines("a")
        await core.register("a", engine.url)
        proxy = await asyncio.wait_for(starting, 10)
        async with http.post(proxy.url + CHAT, json={"model": "m", "messages": []}) as response:
            assert response.status == 200
    finally:
        if proxy is not None:
            await proxy.stop()
        elif not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting


async def test_a_proxy_sharing_its_port_without_a_snapshot_listens_after_the_wait(
        nats_url: str, http: aiohttp.ClientSession) -> None:
    """No snapshot comes (no scheduler): it listens after the wait, and answers 503 no_snapshot."""
    config = ProxyConfig(nats_url=nats_url, host="127.0.0.1", port=0, proxy_id="alone", reuse_port=True)
    proxy = await asyncio.wait_for(start(config, snapshot_wait_s=0.3), 10)
    try:
        async with http.post(proxy.url + CHAT, json={"model": "m", "messages": []}) as response:
            assert response.status == 503 and (await response.json())["error"]["code"] == "no_snapshot"
    finally:
        await proxy.stop()
