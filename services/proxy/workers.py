"""`laswrr proxy --workers N`: N proxy processes on one port, supervised by a parent.

Theory of operation. The parent reserves the listening address first: one socket bound with
``SO_REUSEPORT`` to ``--host``/``--port`` (``--port 0`` learns its free port there), never
listening, held until the parent exits, so the port stays this group's while a worker restarts.
It then starts N workers, each ``python -m laswrr.services.proxy.workers`` with its whole
configuration in its environment (``WORKER_ENV``, JSON: never in argv, where ``--nats-url``'s
password and ``--upstream-api-key`` would be public). Each worker is a full proxy
(services/proxy/app.py) listening on that port with ``reuse_port``; the kernel spreads new
connections over the listening workers. Worker k has the proxy id ``<id>-<k>`` (seeding its own
SWRR sequence), its own random boot id, its own in-flight counts, event publisher and NATS
connection: to the scheduler it is one more proxy replica (docs/proxy.md, "Proxy replicas and
workers"). With ``--admin-port P`` (not 0), worker k serves /metrics and the probes on ``P + k``;
without, each worker serves its own on the shared port (a scrape reaches whichever worker
accepted the connection; ``laswrr_proxy_info{proxy}`` says which).

Workers run in their own session (a terminal's Ctrl-C reaches the parent only) and get SIGTERM
if the parent dies (``PR_SET_PDEATHSIG``, services/children.py). Their stderr is the parent's;
their stdout is copied to the parent's after the first line. The parent prints ``proxy
listening on http://HOST:PORT`` once every worker listens.

Supervision: a worker that exits on its own is restarted with the same id after a backoff
(``RestartPolicy``: 0.5 s doubling to 10 s); one that dies more than ``max_restarts`` times
within the policy's window keeps dying: the parent then stops the others and exits 1. The other
workers serve meanwhile: what they admitted is never touched. SIGTERM or SIGINT: the parent
sends SIGTERM to every worker, each drains as a single proxy does (the socket closes, in-flight
requests get ``--grace-s``, events are flushed, ``lb.proxy.stopped.<id>-<k>``), and the parent
waits for them (a worker still alive ``STOP_MARGIN_S`` after the grace period is killed). Exit
status: 0 when every worker stopped cleanly; 1 when a worker could not start, kept dying, or did
not stop cleanly; 2 for a bad configuration (before anything starts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import msgspec

from laswrr.services import settings
from laswrr.services.children import RestartPolicy, preexec
from laswrr.services.proxy.config import ProxyConfig

log = logging.getLogger("laswrr.proxy.workers")

WORKER_ENV = "LASWRR_PROXY_WORKER"  # the worker's WorkerSpec, JSON
LISTEN_TIMEOUT_S = 30.0
STOP_MARGIN_S = 15.0  # beyond --grace-s: the event flush (5 s) and the NATS drain (5 s), with room


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one worker process needs (in ``WORKER_ENV``)."""

    config: ProxyConfig
    loop: str = "auto"
    log_level: str | None = None
    log_format: str = "text"


def worker_id(proxy_id: str, k: int) -> str:
    return f"{proxy_id}-{k}"


def worker_config(config: ProxyConfig, k: int, port: int) -> ProxyConfig:
    """Worker k's configuration: its own id, the shared port, its admin port."""
    admin = config.admin_port
    return replace(config, proxy_id=worker_id(config.proxy_id, k), port=port, reuse_port=True, workers=1,
                   admin_port=None if admin is None else admin if admin == 0 else admin + k).validate()


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound (SO_REUSEPORT, not listening) to ``host:port``: the workers' port, kept theirs."""
    family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass
class Worker:
    k: int
    spec: WorkerSpec
    process: asyncio.subprocess.Process | None = None
    url: str | None = None
    deaths: list[float] = field(default_factory=list)
    restarts: int = 0
    pump: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.spec.config.proxy_id


class WorkerGroup:
    """The parent's side (module header)."""

    def __init__(self, config: ProxyConfig, loop: str = "auto", log_level: str | None = None,
                 log_format: str = "text", restart: RestartPolicy | None = None,
                 python: str = sys.executable) -> None:
        self.config, self.count, self.python = config, config.workers, python
        self.restart = restart or RestartPolicy()
        self.log_level, self.log_format, self.loop = log_level, log_format, loop
        self.workers: list[Worker] = []
        self.reserved: socket.socket | None = None
        self.port = config.port
        self.stopping = False
        self.failed: asyncio.Future[str] | None = None  # set with the reason when the group must stop
        self.watchers: list[asyncio.Task[None]] = []

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Reserve the port, start every worker, wait until each listens (StartError otherwise)."""
        self.failed = asyncio.get_running_loop().create_future()
        self.reserved = reserve_port(self.config.host, self.config.port)
        self.port = int(self.reserved.getsockname()[1])
        for k in range(self.count):
            spec = WorkerSpec(worker_config(self.config, k, self.port), self.loop, self.log_level, self.log_format)
            self.workers.append(Worker(k, spec))
        results = await asyncio.gather(*(self._spawn(w) for w in self.workers), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        self.watchers = [asyncio.create_task(self._watch(w), name=f"watch-{w.name}") for w in self.workers]

    async def _spawn(self, worker: Worker) -> None:
        env = {**os.environ, WORKER_ENV: msgspec.json.encode(worker.spec).decode(), "PYTHONUNBUFFERED": "1"}
        process = await asyncio.create_subprocess_exec(
            self.python, "-m", "laswrr.services.proxy.workers", stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, env=env, start_new_session=True, preexec_fn=preexec())
        worker.process = process
        worker.url = await self._listening(worker, process)
        worker.pump = asyncio.create_task(_pump(process))
        log.info("worker %s (pid %d) listening on %s", worker.name, process.pid, worker.url)

    async def _listening(self, worker: Worker, process: asyncio.subprocess.Process) -> str:
        from laswrr.services.proxy.cli import LISTEN_PREFIX

        assert process.stdout is not None
        deadline = time.monotonic() + LISTEN_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = (await asyncio.wait_for(process.stdout.readline(), left)).decode(errors="replace")
            except asyncio.TimeoutError:
                break
            if not line:
                code = await process.wait()
                raise StartError(f"worker {worker.name} exited with {code} before listening")
            if line.startswith(LISTEN_PREFIX):
                return line[len(LISTEN_PREFIX):].split()[0]  # the URL, without a note after it
            sys.stdout.write(line)
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        raise StartError(f"worker {worker.name} did not listen within {LISTEN_TIMEOUT_S:g} s")

    async def _watch(self, worker: Worker) -> None:
        while True:
            assert worker.process is not None
            code = await worker.process.wait()
            if self.stopping:
                return
            policy, now = self.restart, time.monotonic()
            worker.deaths = [t for t in worker.deaths if now - t <= policy.window_s] + [now]
            if len(worker.deaths) > policy.max_restarts:
                self._fail(f"worker {worker.name} (pid {worker.process.pid}) exited with {code}: "
                           f"{len(worker.deaths)} deaths within {policy.window_s:g} s, not restarting it again")
                return
            backoff = policy.backoff_s(len(worker.deaths))
            log.error("worker %s (pid %d) exited unexpectedly with %s; restarting it in %g s", worker.name,
                      worker.process.pid, code, backoff)
            await asyncio.sleep(backoff)
            if self.stopping:
                return
            try:
                await self._spawn(worker)
                worker.restarts += 1
            except (OSError, StartError) as exc:  # counts as one more death: the loop waits on it
                log.error("restarting worker %s failed: %s", worker.name, exc)

    def _fail(self, reason: str) -> None:
        log.error("%s; stopping the other workers", reason)
        if self.failed is not None and not self.failed.done():
            self.failed.set_result(reason)

    async def stop(self) -> bool:
        """SIGTERM every worker, wait for each (killed after grace + margin); True if all stopped cleanly."""
        self.stopping = True
        for task in self.watchers:  # no restart from here on
            task.cancel()
        await asyncio.gather(*self.watchers, return_exceptions=True)
        live = [w.process for w in self.workers if w.process is not None and w.process.returncode is None]
        for process in live:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        clean = True
        timeout = self.config.grace_s + STOP_MARGIN_S
        for worker in self.workers:
            process = worker.process
            if process is None:
                continue
            try:
                code = await asyncio.wait_for(process.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("worker %s (pid %d) did not stop within %g s: killed", worker.name, process.pid, timeout)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                code = await process.wait()
            if process in live and code != 0:
                log.warning("worker %s (pid %d) exited with %s", worker.name, process.pid, code)
                clean = False
            if worker.pump is not None:
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(worker.pump, 2.0)
        if self.reserved is not None:
            self.reserved.close()
        return clean


class StartError(RuntimeError):
    """A worker did not come up."""


async def _pump(process: asyncio.subprocess.Process) -> None:
    """The worker's further stdout, copied to ours (a full pipe would block it)."""
    assert process.stdout is not None
    while line := await process.stdout.readline():
        with contextlib.suppress(OSError):
            sys.stdout.write(line.decode(errors="replace"))
            sys.stdout.flush()


async def supervise(group: WorkerGroup) -> int:
    """Run the group until SIGINT/SIGTERM (exit 0 if every worker stopped cleanly) or a failure (1)."""
    from laswrr.services.proxy.cli import LISTEN_PREFIX, bound_note

    stop = settings.stop_event()
    try:
        starting = asyncio.create_task(group.start())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # a signal while the workers start
            starting.cancel()
            with contextlib.suppress(BaseException):
                await starting
            return 0 if await group.stop() else 1
        stopped.cancel()
        starting.result()
    except (OSError, StartError) as exc:
        print(f"proxy: cannot start {group.count} workers on {group.config.host}:{group.config.port}: {exc}",
              file=sys.stderr)
        await group.stop()
        return 1
    print(f"{LISTEN_PREFIX}{group.url}{bound_note(group.config.host)}", flush=True)
    log.info("proxy %s: %d workers on port %d (%s)", group.config.proxy_id, group.count, group.port,
             ", ".join(f"{w.name} pid {w.process.pid}" for w in group.workers if w.process is not None))
    assert group.failed is not None
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({stopped, group.failed}, return_when=asyncio.FIRST_COMPLETED)
    failed = group.failed.done()
    stopped.cancel()
    log.info("%s: stopping %d workers gracefully", "worker failure" if failed else "signal received", group.count)
    clean = await group.stop()
    return 1 if failed or not clean else 0


def run_group(config: ProxyConfig, loop: str, log_level: str | None, log_format: str) -> int:
    """``laswrr proxy --workers N`` (N = ``config.workers``): the exit status."""
    return asyncio.run(supervise(WorkerGroup(config, loop, log_level, log_format)))


# -- the worker process --------------------------------------------------------------------------

def worker_main(environ: Sequence[tuple[str, str]] | None = None) -> int:
    """One worker: its ``WorkerSpec`` from the environment, then ``laswrr proxy`` on it."""
    import argparse

    from laswrr.services.proxy.cli import serve_config

    source = dict(environ) if environ is not None else os.environ
    text = source.get(WORKER_ENV)
    if not text:
        print(f"proxy worker: no {WORKER_ENV} in the environment (started by `laswrr proxy --workers N`)",
              file=sys.stderr)
        return 2
    spec = msgspec.json.decode(text, type=WorkerSpec)
    os.environ.pop(WORKER_ENV, None)  # not inherited by anything this process starts
    settings.configure_logging(argparse.Namespace(log_level=spec.log_level, log_format=spec.log_format), "proxy")
    return serve_config(spec.config, spec.loop)


if __name__ == "__main__":
    sys.exit(worker_main())
