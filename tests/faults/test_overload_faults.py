"""Faults during overload: with flow control on and the pool offered twice what its slots take,
kill -9 (by its own pid, each while requests are held) one engine, then the scheduler, then one
proxy worker, then one nats-server of a three-node cluster. Every request gets an answer: a
whole stream (200 to its ``data: [DONE]``), or the proxy's own 429 or 503 with ``Retry-After``;
none waits past its time to live (the client gives up a little after it: a timeout is a
failure); no admitted stream is cut by the router; the log has every message once, every held
request leaves the queue (dispatched or refused), and replay is exact.

The one exception is the proxy worker killed: the requests it held or streamed were its clients'
connections, which die with the process (docs/proxy.md, "Never cut": a worker killed loses only
the requests it held). They are counted apart, from the client (a connection that broke at the
kill, on a request of that worker or not yet answered) and from the log (``interruptions`` rows
``proxy_gone`` of that worker, held requests of that worker that never left its queue), and
nothing else may be lost.

Real parts: a three-node NATS cluster started by the test (``NatsCluster``, streams with three
replicas; the test starts the killed node again, as its own supervisor would) and `laswrr up
--nats-url <the three> --proxy-workers 2` as a child process, which restarts the engine, the
scheduler and the worker: flow control on (its default under `up`), the five simulated engines
with a slot limit of a quarter of their slots (``concurrency_limit_factor = 0.25``: 11 slots) and
a 3 s ejection, so the pool is small and the killed engine is back within the test; clients
streaming chat completions in the three bands, twice as many as the slots.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from laswrr.replay import store
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import decode_snapshot
from laswrr.services.natsbus import connect, wait_jetstream
from laswrr.services.nats_server import NatsCluster, free_ports
from laswrr.services.up import load_nodes
from tests.conftest import Eventually
from tests.faults.test_nats_cluster_kill import current_in, events_cluster
from tests.faults.test_proxy_sigterm_held import queue_depth
from tests.faults.test_rolling_restart import worker_pids
from tests.faults.test_up_supervision import working_again
from laswrr.services.children import exited
from tests.up_process import LogAudit, UpStderr, audit_log, no_leftover_stack, start_up

no_leftover_stack = pytest.fixture(autouse=True)(no_leftover_stack)
pytestmark = pytest.mark.timeout(300)

TTL_S = 3.0  # --queue-ttl-ms: a held request is dispatched or answered 429 within this
HEAD_TIMEOUT_S = TTL_S + 4.0  # the client's wait for an answer's headers: the TTL, then a dispatch
STREAM_TIMEOUT_S = 20.0  # the client's wait for a stream's end once it began
MAX_TOKENS = 48
SIM_SPEED = 4  # a stream of MAX_TOKENS lasts about half a second
BANDS = ("interactive", "default", "default", "batch")  # the clients' priorities, in turn
REFUSALS = {429: {"queue_timeout", "queue_full"}, 503: {"no_routable_node", "shutting_down"}}
CONFIG = "[scheduler]\nconcurrency_limit_factor = 0.25\nbase_ejection_ms = 3000\n"
ENGINE = "sim-910c-1"  # the engine killed: the most slots, so the most streams to continue elsewhere
WORKER = "proxy-0"  # the proxy worker killed
WORKERS = 2
RECOVERY_S = 60.0  # each fault's recovery, with room for a loaded machine


@dataclass
class Outcome:
    """One client request, from the client's side."""

    band: str
    began: float
    ended: float = 0.0
    status: int | None = None  # None: no answer (the connection broke, or the client gave up)
    head_s: float | None = None  # when the answer's headers came, from the send
    retry_after: str | None = None
    code: str | None = None  # the error's code of an answer that is not a 200
    request_id: str | None = None
    node: str | None = None
    done: bool = False  # a 200 stream that ended with data: [DONE]
    error: str | None = None

    @property
    def served(self) -> bool:
        return self.status == 200 and self.done

    @property
    def refused(self) -> bool:
        """The proxy's own clean refusal: a known 429 or 503 with a Retry-After of a second or more."""
        return (self.code in REFUSALS.get(self.status or 0, ()) and self.retry_after is not None
                and self.retry_after.isdigit() and int(self.retry_after) >= 1)


@dataclass
class Clients:
    """``count`` clients streaming chat completions through ``url`` until ``stop()``."""

    url: str
    count: int
    outcomes: list[Outcome] = field(default_factory=list)

    def start(self) -> None:
        self.running = True
        self.tasks = [asyncio.create_task(self._client(BANDS[i % len(BANDS)])) for i in range(self.count)]

    async def stop(self) -> None:
        self.running = False
        await asyncio.gather(*self.tasks)

    def served_since(self, t: float, node: str | None = None) -> int:
        return sum(1 for o in self.outcomes if o.served and o.began >= t and (node is None or o.node == node))

    async def _client(self, band: str) -> None:
        # a new connection per request: each goes to whichever proxy worker the kernel picks
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            while self.running:
                outcome = await self._request(http, band)
                self.outcomes.append(outcome)
                if not outcome.served:
                    await asyncio.sleep(0.2)

    async def _request(self, http: aiohttp.ClientSession, band: str) -> Outcome:
        body = {"model": "default", "stream": True, "max_tokens": MAX_TOKENS,
                "messages": [{"role": "user", "content": "hi"}]}
        outcome = Outcome(band, time.monotonic())
        try:
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                response = await http.post(f"{self.url}/v1/chat/completions", json=body,
                                           headers={"x-laswrr-priority": band})
            async with response:
                outcome.status, outcome.head_s = response.status, time.monotonic() - outcome.began
                outcome.retry_after = response.headers.get("Retry-After")
                outcome.request_id = response.headers.get("x-laswrr-request-id")
                outcome.node = response.headers.get("x-laswrr-node")
                async with asyncio.timeout(STREAM_TIMEOUT_S):
                    data = await response.read()
                if response.status == 200:
                    outcome.done = data.rstrip().endswith(b"data: [DONE]")
                else:
                    outcome.code = json.loads(data)["error"]["code"]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            outcome.error = type(exc).__name__
        outcome.ended = time.monotonic()
        return outcome


class Held:
    """Each proxy worker's held requests (``laswrr_proxy_queue_depth`` on its admin port), sampled."""

    def __init__(self, admin_port: int) -> None:
        self.urls = {f"proxy-{k}": f"http://127.0.0.1:{admin_port + k}" for k in range(WORKERS)}
        self.now = {name: 0 for name in self.urls}
        self.samples: list[tuple[float, int]] = []  # (when, held by all workers)

    async def sample(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            while True:
                for name, url in self.urls.items():
                    try:
                        self.now[name] = await queue_depth(http, url)
                    except (aiohttp.ClientError, asyncio.TimeoutError):
                        self.now[name] = 0  # restarting
                self.samples.append((time.monotonic(), sum(self.now.values())))
                await asyncio.sleep(0.1)

    def most(self, since: float = 0.0) -> int:
        return max((n for t, n in self.samples if t >= since), default=0)

    def total(self, worker: str | None = None) -> int:
        return self.now[worker] if worker else sum(self.now.values())


async def engine_running(url: str) -> int:
    """Requests the simulated engine at ``url`` runs now (its vLLM-style gauge)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        async with http.get(f"{url}/metrics") as response:
            text = await response.text()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:num_requests_running")))


async def other_leader(js, old: str) -> bool:  # type: ignore[no-untyped-def]
    info = await events_cluster(js)
    return info is not None and info.leader is not None and info.leader != old


@dataclass
class Overload:
    """The stack under overload, and the faults put to it: one line of figures per fault."""

    up: asyncio.subprocess.Process
    banner: dict[str, str]
    cluster: NatsCluster
    nc: Any
    data: Path
    clients: Clients
    held: Held
    eventually: Eventually
    stderr: UpStderr = field(init=False)
    kills: dict[str, float] = field(default_factory=dict)  # when each was killed
    gone: dict[str, float] = field(default_factory=dict)  # when its process was seen gone (its sockets closed)
    figures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stderr = UpStderr(self.up)

    async def until(self, condition: Callable[[], object], what: str, interval_s: float = 0.05) -> float:
        """Until ``condition`` (a function or a coroutine function) is true; the monotonic time then."""
        await self.eventually(condition, RECOVERY_S, what, interval_s)
        return time.monotonic()

    async def fault(self, name: str, pid: int, recovered: Callable[[float], Awaitable[str]],
                    ready: Callable[[], object]) -> None:
        """Once requests are held (and ``ready``): kill -9 ``pid``, wait for the recovery and for
        requests served after it; one line of figures."""
        await self.until(ready, f"requests held before the {name} kill")
        holding, before = self.held.total(), len(self.clients.outcomes)
        killed = self.kills[name] = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        gone = self.gone[name] = await self.until(lambda: exited(pid), f"the {name} process gone", 0.002)
        recovery = await recovered(killed)
        mark = time.monotonic()
        await self.until(lambda: self.clients.served_since(mark) >= 10, f"serving after the {name} recovery")
        during = self.clients.outcomes[before:]
        self.figures.append(f"{name} killed with {holding} held: exited after {gone - killed:.3f} s, {recovery}; "
                            f"meanwhile held at most "
                            f"{self.held.most(killed)}, served {sum(o.served for o in during)}, refused "
                            f"{sum(o.refused for o in during)}, other {sum(not o.served and not o.refused for o in during)}")

    async def engine(self) -> None:
        url = next(node.url for node in load_nodes(self.data / "nodes.toml") if node.id == ENGINE)

        async def back(killed: float) -> str:
            started = await self.stderr.wait_for(rf"started {ENGINE} \(pid (\d+)\)", count=2, timeout_s=RECOVERY_S)
            restarted = time.monotonic() - killed
            serving = await self.until(lambda: self.clients.served_since(killed, ENGINE) > 0, f"{ENGINE} serving")
            return (f"restarted in {restarted:.2f} s (pid {started.group(1)}), serving again after "
                    f"{serving - killed:.2f} s")

        async def ready() -> bool:  # requests held, and streams on the engine to continue elsewhere
            return self.held.total() > 0 and await engine_running(url) > 0

        await self.fault(f"engine {ENGINE}", int(self.banner[f"pid {ENGINE}"]), back, ready)

    async def scheduler(self) -> None:
        async def back(killed: float) -> str:
            started = await self.stderr.wait_for(r"started scheduler \(pid (\d+)\)", count=2, timeout_s=RECOVERY_S)
            restarted = time.monotonic() - killed
            await asyncio.wait_for(working_again("scheduler", self.nc, self.cluster.url, self.data), RECOVERY_S)
            return (f"restarted in {restarted:.2f} s (pid {started.group(1)}), answering commands after "
                    f"{time.monotonic() - killed:.2f} s")

        await self.fault("scheduler", int(self.banner["pid scheduler"]), back, lambda: self.held.total() > 0)

    async def worker(self) -> None:
        log = self.data / "logs" / "proxy.log"
        pid = worker_pids(log)[WORKER]

        async def back(killed: float) -> str:
            restarted = await self.until(lambda: worker_pids(log).get(WORKER, pid) != pid, f"{WORKER} restarted")
            return f"restarted in {restarted - killed:.2f} s (pid {worker_pids(log)[WORKER]})"

        await self.fault(f"proxy worker {WORKER}", pid, back, lambda: self.held.total(WORKER) > 0)

    async def nats_leader(self) -> None:
        """The leader of LB_EVENTS (the worst case: the stream elects a new one)."""
        js = self.nc.jetstream()
        info = await events_cluster(js)
        assert info is not None and info.leader is not None
        leader = info.leader
        node = self.cluster.nodes[int(leader.rpartition("-")[2]) - 1]  # nats-<i>
        assert node.process is not None

        async def back(killed: float) -> str:
            elected = await self.until(lambda: other_leader(js, leader), "a new LB_EVENTS leader")
            node.spawn()  # what its supervisor does: same ports, same store (from the loop's thread)
            await asyncio.to_thread(node.wait_ready)
            rejoined = await self.until(lambda: current_in_events(js, leader), f"{leader} a current replica again")
            return (f"LB_EVENTS leader re-elected after {elected - killed:.2f} s, {leader} started again and a "
                    f"current replica after {rejoined - killed:.2f} s")

        await self.fault(f"nats-server {leader} (LB_EVENTS leader)", node.process.pid, back,
                         lambda: self.held.total() > 0)


async def current_in_events(js, node: str) -> bool:  # type: ignore[no-untyped-def]
    return current_in(await events_cluster(js), node)


@dataclass
class Log:
    """What the stopped stack's log says of the requests (replay/views.sql)."""

    audit: LogAudit
    gone: dict[str, tuple[str, str]]  # interruptions: request id -> (reason, proxy)
    left: dict[str, int]  # held requests by how they left the queue ('never': still held at the end)
    never_left: dict[str, str]  # held requests that never left: request id -> proxy
    completed: set[str]
    outcomes: dict[str, int]
    refused: dict[str, int]  # request id -> status
    continuations: dict[str, int]

    @classmethod
    def read(cls, db: Path, audit: LogAudit) -> "Log":
        with store.open_read(db) as con:
            def rows(sql: str) -> list[Any]:
                return con.execute(sql).fetchall()

            return cls(audit, {r[0]: (r[1], r[2]) for r in rows("SELECT request_id, reason, proxy FROM interruptions")},
                       dict(rows("SELECT coalesce(ended, 'never'), count(*) FROM queued GROUP BY ALL")),
                       dict(rows("SELECT request_id, proxy FROM queued WHERE ended IS NULL")),
                       {r[0] for r in rows("SELECT request_id FROM requests WHERE outcome = 'completed'")},
                       dict(rows("SELECT coalesce(outcome, 'open'), count(*) FROM requests GROUP BY ALL")),
                       dict(rows("SELECT request_id, status FROM refusals")),
                       dict(rows("SELECT kind, count(*) FROM continuations GROUP BY ALL")))


async def test_faults_during_overload_lose_no_request(tmp_path: Path, eventually: Eventually) -> None:
    data = tmp_path / "data"
    (tmp_path / "overload.toml").write_text(CONFIG)
    admin = free_ports(WORKERS)
    with NatsCluster(tmp_path / "nats", 3, log_dir=tmp_path) as cluster:
        nc = await connect(cluster.url, "fault-test")
        try:
            await wait_jetstream(nc, 30)
            up, banner = await start_up(
                "--nats-url", cluster.url, "--stream-replicas", "3", "--data-dir", str(data), "--proxy-port", "0",
                "--dashboard-port", "0", "--proxy-workers", str(WORKERS), "--sim-speed", str(SIM_SPEED),
                "--config", str(tmp_path / "overload.toml"), "--proxy-arg", f"queue-ttl-ms={int(TTL_S * 1000)}",
                "--proxy-arg", f"admin-port={admin}")
            kv = await nc.jetstream().key_value(sj.WEIGHTS_BUCKET)
            slots = sum(n.concurrency_limit for n in decode_snapshot((await kv.get("default")).value or b"").nodes)
            run = Overload(up, banner, cluster, nc, data, Clients(banner["proxy URL"].split()[0], 2 * slots),
                           Held(admin), eventually)
            sampler = asyncio.create_task(run.held.sample())
            run.clients.start()
            try:
                await run.until(lambda: run.clients.served_since(0) >= 20, "the clients served")
                for fault in (run.engine, run.scheduler, run.worker, run.nats_leader):
                    await fault()
                assert up.returncode is None
            finally:
                await run.clients.stop()
                sampler.cancel()
            up.send_signal(signal.SIGINT)
            await asyncio.wait_for(up.wait(), 120)
            assert up.returncode == 0, run.stderr.text()[-3000:]
            audit = await audit_log(nc, data / store.DB_FILE)
        finally:
            if not nc.is_closed:  # the test failed before the audit, which closes it
                await nc.close()
    log = Log.read(data / store.DB_FILE, audit)
    worker = f"proxy worker {WORKER}"
    outcomes, worker_kill, worker_gone = run.clients.outcomes, run.kills[worker], run.gone[worker]
    served = [o for o in outcomes if o.served]
    refused = [o for o in outcomes if o.refused]
    # the killed worker's clients: a connection that broke at the kill (no answer yet, or mid-stream), on a
    # request sent before the process was gone (until it exits, the kernel may still hand it new connections)
    with_worker = [o for o in outcomes if not o.served and not o.refused and o.status in (None, 200)
                   and o.began <= worker_gone and o.ended >= worker_kill and (o.request_id or WORKER).startswith(WORKER)]
    lost = [o for o in outcomes if not o.served and not o.refused and o not in with_worker]
    # what a client got, the log has: a whole stream completed, a refusal under its id with its status
    unrecorded = [o for o in served if o.request_id not in log.completed] + \
        [o for o in refused if log.refused.get(o.request_id or "") != o.status]
    for line in run.figures:
        print(f"FAULT overload {line}")
    print(f"FAULT overload totals ({run.clients.count} streaming clients on {slots} slots, TTL {TTL_S:g} s): "
          f"requests {len(outcomes)}, served {len(served)}, refused {len(refused)} "
          f"{dict(Counter(f'{o.status} {o.code}' for o in refused))}, held max {run.held.most()}, longest wait for "
          f"an answer's headers {max(o.head_s or 0 for o in outcomes):.2f} s; lost with the killed worker: "
          f"{len(with_worker)} client connections ({sum(o.status is None for o in with_worker)} before an answer, "
          f"{sum(o.status == 200 for o in with_worker)} mid-stream), in the log {len(log.gone)} open streams and "
          f"{len(log.never_left)} held requests of {WORKER}; other failures {len(lost)}; held requests by how they "
          f"left {log.left}; requests by outcome {log.outcomes}; continuations {log.continuations}; answers not in "
          f"the log {len(unrecorded)}; {audit.line()}")
    for o in lost:
        print(f"LOST {o}", {name: (round(o.began - at, 3), round(o.ended - at, 3)) for name, at in run.kills.items()})
    assert not lost, f"{len(lost)} requests neither served whole nor refused cleanly (LOST lines above)"
    # cut by the router: none; open at the end: only the killed worker's, voided when it restarted
    assert all(reason == "proxy_gone" and proxy == WORKER for reason, proxy in log.gone.values()), log.gone
    assert set(log.never_left.values()) <= {WORKER}, log.never_left  # every other held request left the queue
    # only what the killed worker answered just before it died can miss its event (still in its buffer)
    assert all((o.request_id or "").startswith(f"{WORKER}-") and o.ended >= worker_kill - 1.0 for o in unrecorded), \
        unrecorded
    # each request the log shows open at the killed worker is a client that lost its connection, or
    # one whose answer came whole with the events still in the worker's buffer (the clients may count
    # more: a connection the kernel queued for the worker that it never accepted left no event)
    assert len(log.gone) + len(log.never_left) <= len(with_worker) + len(unrecorded)
    assert "not routing yet" not in run.stderr.text()  # up asked its workers on their admin ports
    assert audit.rows == audit.published and audit.distinct == sum(audit.rows.values())
