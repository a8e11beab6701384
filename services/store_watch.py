"""`laswrr up`'s watch over the disk of its data dir and the store of its embedded nats-server.

Theory of operation. Under `laswrr up` the data dir holds both the recorder's DuckDB file and
the embedded nats-server's JetStream store (``<data_dir>/jetstream``), so one full disk stops
both. The recorder copes by itself (services/recorder.py, "A full disk"). nats-server does not:
a write that fails (``no space left on device``) marks the stream broken, and from then on it
stores nothing more in that stream (it answers no publish; its log says ``critical write
error``) until the server restarts, however much space is freed. Meanwhile the proxies keep
serving on their last snapshot and hold their request events in their bounded buffers
(services/proxy/events.py: beyond ``--event-buffer`` the oldest are dropped, counted in
``laswrr_proxy_events_dropped_total`` and logged), the scheduler retries its outputs, the
collector's samples of that time are lost (counted as its publish errors), and nothing new
reaches the stream, so nothing new reaches the recorder.

So every ``interval_s`` the watch (``StoreWatch.run``):

* reads the free space of each disk it watches: below ``ROOM_BYTES`` it says so once, an ERROR
  line on `laswrr up`'s own stderr (the log files are on that disk), and once more when there
  is room again;
* asks each embedded server's ``/healthz`` (``EmbeddedNats.store_errors``): on a stream's write
  error it says so, waits until the store's disk has ``ROOM_BYTES`` free, and restarts the
  server: same port, same store, so the streams come back with everything stored before the
  error; every service reconnects by itself, the proxies send the events they held (JetStream's
  de-duplication window keeps one copy of a batch sent twice), the scheduler publishes what it
  owes, and the recorder records on. Restarts that follow each other (the disk filled again)
  are spaced by the children's backoff (``RestartPolicy``).

With ``--nats-cluster N`` every node's store is on the data dir's disk, so a full disk stops
them all at once (a node whose raft log fails a write says ``JetStream not enabled`` on its
``/healthz``, a stopped stream ``write error``): the watch restarts each broken node in turn, one at a time (the others keep
the cluster's quorum while one restarts, once the first is back). While it restarts a node it
holds it in ``restarting``, so `laswrr up`'s supervision of the cluster's nodes (which starts a
node that died) leaves that one alone.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from laswrr.services.children import RestartPolicy
from laswrr.services.nats_server import EmbeddedNats

log = logging.getLogger("laswrr.up")

ROOM_BYTES = 64 << 20  # less free than this on a watched disk: said; a stuck store restarts only with this much
MB = 1 << 20
# What a store that failed a write says on /healthz: a single server names the stream's "critical
# write error"; a cluster's node also fails its raft log's write and disables JetStream altogether.
STUCK = ("write error", "JetStream not enabled")
RUNBOOK = '''docs/runbook.md, "When the data dir's disk fills up"'''  # what the ERROR line points to


def free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


class StoreWatch:
    """The watch of the module doc over ``disks`` (``(what is there, path)``) and the embedded
    ``servers`` (each made with ``monitor=True``)."""

    def __init__(self, disks: Sequence[tuple[str, Path]], servers: Sequence[EmbeddedNats] = (),
                 interval_s: float = 1.0, room_bytes: int = ROOM_BYTES, policy: RestartPolicy | None = None) -> None:
        self.disks = list(disks)
        self.servers = list(servers)
        self.interval_s = interval_s
        self.room_bytes = room_bytes
        self.policy = policy or RestartPolicy()
        self.short: set[Path] = set()  # the disks said to be short of room
        self.restarts: list[float] = []  # monotonic times of the servers' restarts
        self.restarting: EmbeddedNats | None = None  # the server being restarted now, if any

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.check_disks()
            for server in self.servers:
                if server.process is None or server.process.poll() is not None:
                    continue
                try:
                    errors = await asyncio.to_thread(server.store_errors)
                except OSError as exc:
                    log.debug("nats-server /healthz did not answer: %s", exc)
                    continue
                broken = [e for e in errors if any(sign in e for sign in STUCK)]
                if broken:
                    self.restarting = server
                    try:
                        await self.recover(server, broken)
                    finally:
                        self.restarting = None

    def check_disks(self) -> None:
        for what, path in self.disks:
            free = free_bytes(path)
            if free is None:
                continue
            if free < self.room_bytes and path not in self.short:
                self.short.add(path)
                log.error("the disk of %s has %.1f MB free (less than %d MB): %s cannot be written; clients "
                          "are still served; free space there (%s)", path, free / MB, self.room_bytes // MB, what,
                          RUNBOOK)
            elif free >= self.room_bytes and path in self.short:
                self.short.discard(path)
                log.warning("the disk of %s has room again (%.1f MB free)", path, free / MB)

    async def recover(self, server: EmbeddedNats, errors: list[str]) -> None:
        """``server``'s store cannot write: once its disk has room, restart it (again, after a
        backoff, until it runs)."""
        assert server.process is not None
        old = server.process.pid
        log.error("JetStream stopped storing (%s): nothing new reaches the streams or the recorder; the proxies "
                  "hold their events meanwhile; nats-server (pid %d) is restarted once %s has %d MB free",
                  "; ".join(errors), old, server.store_dir, self.room_bytes // MB)
        while True:
            while (free_bytes(server.store_dir) or 0) < self.room_bytes:
                await asyncio.sleep(self.interval_s)
                self.check_disks()
            now = time.monotonic()
            self.restarts = [t for t in self.restarts if now - t <= self.policy.window_s] + [now]
            if len(self.restarts) > 1:
                await asyncio.sleep(self.policy.backoff_s(len(self.restarts) - 1))
            await asyncio.to_thread(server.stop)
            try:
                server.spawn()  # from the loop's thread: PDEATHSIG follows the spawning thread
                await asyncio.to_thread(server.wait_ready)
            except (OSError, RuntimeError, TimeoutError) as exc:
                log.error("restarting nats-server failed: %s; trying again", exc)
                continue
            assert server.process is not None
            log.warning("restarted nats-server (pid %d, was %d) at %s: JetStream stores again; the services "
                        "reconnect by themselves", server.process.pid, old, server.url)
            return
