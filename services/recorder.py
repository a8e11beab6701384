"""`laswrr recorder`: every message of LB_EVENTS and LB_OUT, exactly once, into DuckDB.

Theory of operation.

* **Durable pull consumers, AckAll.** One durable consumer per stream (``<durable>-events``,
  ``<durable>-out``; ack policy ``all``, no ack-pending limit), recreated at start from the
  database's highest recorded seq + 1: the file, not the consumer, says where to resume. Each is
  read with raw pull requests (``PullReader.fetch``, services/jsreader.py: ``batch`` messages or
  ``flush_ms`` of waiting, whichever comes first) into a callback subscription: nats-py's
  ``fetch`` waits on every message separately (services/jsreader.py says why that is slow).
* **Commit, then ack.** A batch becomes one row per message — ``(stream, stream seq, ts_ns,
  subject, data, raw)`` with ``ts_ns`` the exact JetStream timestamp from the ack subject (the
  same time the scheduler used) and the payload's exact bytes, malformed or not, not UTF-8 or
  not (replay/store.py says how ``data`` and ``raw`` hold them) — inserted
  in one transaction; only then is the batch's highest message acked, which (AckAll)
  acknowledges everything before it. A crash before the ack means redelivery, and a redelivered
  message is not inserted again: none lost, none duplicated. The recorder knows what the file
  holds without asking it (the table has no key, replay/store.py says why): every seq up to
  ``recorded_through`` (read from the file at start, after its holes are filled), plus the seqs
  of a batch written past a hole it could not fill yet (``written_above``, until the hole is
  filled); ``_commit`` leaves those out of each batch. A proxy's
  ``lb.req.batch.<proxy>`` message is one row like any other, its bytes as received; the
  analyst views unnest its events (replay/views.sql).
* **No silent holes.** Acking seq S also acknowledges every earlier message, including one that
  was delivered but lost on the way (a reconnect). So before acking, any seq missing between the
  last recorded one and S is fetched directly from the stream (``STREAM.MSG.GET``); a seq the
  stream no longer has (deleted, or dropped by retention) is logged as a gap, and the same
  check runs once over the whole file at start.
* **Pipelining.** The next pull request is in flight while a batch is committed in a worker
  thread; one lock serialises every use of the DuckDB connection.
* **A trickle waits longer.** A fetch that brought at most ``TRICKLE_PER_S`` (10) messages a
  second of its wait doubles the next one's, up to ``idle_flush_ms`` (2 s); a fuller one sets it
  back to ``flush_ms``. An idle stack's ~5 rows a second then cost one pull and one commit per
  stream every 2 s instead of five; the file lags the streams by up to 2 s, once, when traffic
  starts, and a copy for a reader (below) may wait that long for LB_EVENTS. A stop cuts the wait
  short (``PullReader.hurry``).
* **One writer per DuckDB file** (docs/design.md, "Hazards designed for"). Readers (``laswrr replay|report|export --db``)
  that find the file locked send a request on ``lb.recorder.snapshot`` (``{"db": path, "to":
  path}``; ``to`` must be a new file inside the recorder's data directory, anything else is
  refused with the reason); the recorder that owns ``db`` pauses committing LB_OUT, records
  LB_EVENTS up to the stream's last seq at the time of the request (so every recorded output has its input),
  copies the database into ``to`` with DuckDB's ``COPY FROM DATABASE`` and replies ``{"path": to}`` (or ``{"error": ...}``).
  A recorder that does not own ``db`` stays silent. Both ends are services/recorder_copy.py
  (``copy_from_recorder``, ``CopyDesk``); this loop only holds LB_OUT at the desk's gate and
  lets it copy as LB_EVENTS advances.
* **A full disk.** A commit DuckDB refuses (its WAL or file cannot grow: the transaction is
  rolled back, the file stays whole) is tried again, 0.5 s doubling to ``WRITE_RETRY_MAX_S``,
  with nothing acked meanwhile (JetStream keeps the messages; the stream's own limits apply):
  an ERROR line, ``laswrr_recorder_write_failing`` 1 and ``laswrr_recorder_write_failures``
  say so, and recording resumes by itself once there is room (``_write``; a refused commit
  wrote nothing, so the retried batch adds no duplicate).
* **Stop.** SIGINT/SIGTERM: the stop's target is each stream's last seq at that moment
  (``STREAM.INFO``); the recorder keeps pulling, committing and acking (recreating a consumer that
  is gone, e.g. seconds after a leader election) until it has recorded through both targets or
  ``stop_catch_up_s`` has passed, whichever comes first. Hitting the bound logs one warning line
  per stream still short, with the seqs not recorded (the stream keeps them; the next start
  records them). LB_OUT's target is read first and LB_OUT is committed only up to it, so every
  output in the file has its input there (a replay finds no output beyond its inputs). Then it
  drains the connection, closes the database and exits 0. So the file a stopped recorder leaves
  holds everything the streams held when it was told to stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
from nats.aio.client import Client
from nats.aio.msg import Msg
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from laswrr.replay import store
from laswrr.schemas import subjects as sj
from laswrr.services import settings
from laswrr.services.jsreader import PullReader, ack_all_consumer, get_envelope, parse_ack_subject
from laswrr.services.natsbus import NatsAuth, StreamLimits, connect, ensure_streams, redact_url
from laswrr.services.recorder_copy import CopyDesk
from laswrr.services.service_metrics import BATCH_BUCKETS, Buckets, Metric, lag, render, serve_metrics

log = logging.getLogger("laswrr.recorder")
WRITE_RETRY_MAX_S = 5.0  # the longest wait between two attempts of a commit DuckDB refused (_write)
TRICKLE_PER_S = 10  # a fetch that brought at most this many messages a second of its wait: wait longer next


# the most the recorder raises DuckDB's limit to: half the host's memory (then a refusal waits and retries)
MEMORY_LIMIT_MAX_MB = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2) >> 20


@dataclass
class RecorderOptions:
    data_dir: Path = Path(settings.DEFAULT_DATA_DIR)
    batch: int = 5000
    flush_ms: int = 200
    idle_flush_ms: int = 2000  # the longest wait of a fetch while the stream trickles (<= flush_ms: off)
    durable: str = "recorder"
    stream_replicas: int = StreamLimits.replicas  # of the streams it creates where missing (a cluster)
    stop_catch_up_s: float = 10.0  # on SIGTERM/SIGINT: longest time to record up to the streams' last seqs
    memory_limit_mb: int = 16  # DuckDB's memory on the writer, raised as commits need (``_write``); 0: DuckDB's own

    @property
    def db_path(self) -> Path:
        return self.data_dir / store.DB_FILE


@dataclass
class StreamStats:
    recorded: int = 0
    batches: int = 0
    repaired: int = 0
    gaps: int = 0
    write_failures: int = 0  # commits DuckDB refused (a full disk): retried, nothing acked meanwhile
    failing: bool = False  # the last commit attempt failed
    batch_seconds: Buckets = field(default_factory=lambda: Buckets(BATCH_BUCKETS))  # one commit


class Recorder:
    """``await run(stop)`` records both streams until ``stop`` is set."""

    def __init__(self, nc: Client, options: RecorderOptions) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.options = options
        self.con: duckdb.DuckDBPyConnection | None = None
        self.stats = {sj.EVENTS_STREAM: StreamStats(), sj.OUT_STREAM: StreamStats()}
        self.recorded_through = {sj.EVENTS_STREAM: 0, sj.OUT_STREAM: 0}
        self.written_above: dict[str, set[int]] = {stream: set() for stream in self.recorded_through}
        self.ready = asyncio.Event()
        self._db_lock = asyncio.Lock()
        self.copies = CopyDesk(options.db_path, options.data_dir, self.js, self._db, self._db_lock,
                               lambda: self.con, lambda: self.memory_limit_mb)  # lb.recorder.snapshot (services/recorder_copy.py)
        self._stop_targets: dict[str, int] = {}  # stream -> its last seq when the stop came
        self._stop_deadline = 0.0  # monotonic time the catch-up on stop gives up
        self._stop_targets_read = asyncio.Event()  # _plan_stop has read them (or given up)
        self._readers: list[PullReader] = []
        self.memory_limit_mb = options.memory_limit_mb  # in force; raised when DuckDB needs more (``_write``)
        self.memory_raised = 0  # times it was
        self._reopen_needed = False  # a fatal error invalidated ``con``: open the file again before the next write

    # -- lifecycle ------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        self.con = await asyncio.to_thread(store.open_writer, self.options.db_path, self.memory_limit_mb or None)
        if await self._db(store.has_key, self.con):
            log.info("%s was made with a primary key on (stream, seq): its index grows the recorder's memory by "
                     "about 180 bytes a row (docs/analysts.md, \"A file made with the key\")", self.options.db_path)
        try:
            await ensure_streams(self.js, StreamLimits(replicas=self.options.stream_replicas))
            for stream in self.stats:
                first = (await self.js.stream_info(stream)).state.first_seq
                recorded = await self._db(store.max_seq, self.con, stream)
                if recorded and first - 1 > recorded:
                    log.warning("%s seqs %d..%d were dropped by retention before they were recorded",
                                stream, recorded + 1, first - 1)
                self.recorded_through[stream] = max(recorded, first - 1)
                await self._repair_holes(stream)
            readers = self._readers = [PullReader(self.nc, self.js, stream, self.options.batch) for stream in self.stats]
            for reader in readers:
                await self._open(reader)
            await self.nc.subscribe(sj.RECORDER_SNAPSHOT, cb=self.copies.on_request)
            log.info("recording %s into %s (batch %d, flush %d ms)", ", ".join(self.stats),
                     self.options.db_path, self.options.batch, self.options.flush_ms)
            self.ready.set()
            stopping = asyncio.create_task(self._plan_stop(stop))
            try:
                await asyncio.gather(*(self._record(reader, stop) for reader in readers))
                with contextlib.suppress(Exception):  # the targets, for the log line (bounded)
                    await asyncio.wait_for(stopping, 2.0)
            finally:
                stopping.cancel()
            self._log_short()
        finally:
            self.copies.close()
            await asyncio.to_thread(self.con.close)
            self.con = None
            log.info("stopped: %s", ", ".join(f"{s} {st.recorded} rows" for s, st in self.stats.items()))

    async def _db(self, fn: Any, *args: Any) -> Any:
        async with self._db_lock:
            return await asyncio.to_thread(fn, *args)

    # -- the batch loop -------------------------------------------------------------------------

    async def _record(self, reader: PullReader, stop: asyncio.Event) -> None:
        stream, flush_s = reader.stream, self.options.flush_ms / 1000
        pending: asyncio.Task[list[Msg]] | None = None
        wait_s = flush_s
        while True:
            msgs = await (pending or reader.fetch(wait_s))
            pending = None
            trickle = len(msgs) <= wait_s * TRICKLE_PER_S and not stop.is_set()
            wait_s = min(2 * wait_s, max(flush_s, self.options.idle_flush_ms / 1000)) if trickle else flush_s
            if self._keep_reading(stream, stop):
                pending = asyncio.create_task(reader.fetch(wait_s))
            if not msgs and reader.gone is not None:
                await self._recover(reader, stop)
            if msgs and stream == sj.OUT_STREAM and stop.is_set():
                msgs = await self._up_to_stop_target(msgs)
            if msgs:
                if stream == sj.OUT_STREAM:
                    await self.copies.gate.wait()  # closed while a reader's copy waits for LB_EVENTS
                highest = await self._commit(stream, msgs)
                if highest is not None:
                    with contextlib.suppress(Exception):  # a lost ack only means a redelivery
                        await highest.ack()  # AckAll: acknowledges every message up to this one
            if stream == sj.EVENTS_STREAM:
                await self.copies.serve(self.recorded_through[stream], final=pending is None)
            if pending is None:
                return

    # -- stopping -------------------------------------------------------------------------------

    async def _plan_stop(self, stop: asyncio.Event) -> None:
        """Once the stop comes: each stream's last seq then is the target to record up to (asked
        until the bound, at least once, so that a stop without catch-up can still say what it
        left). LB_OUT's is read first, so every output up to its target has its input up to
        LB_EVENTS' target (a replay of the file finds no output beyond its inputs)."""
        await stop.wait()
        self._begin_stop()
        for reader in self._readers:
            reader.hurry()  # a trickle's long wait: the catch-up starts now
        try:
            for stream in (sj.OUT_STREAM, sj.EVENTS_STREAM):
                while stream not in self._stop_targets:
                    try:
                        info = await asyncio.wait_for(self.js.stream_info(stream), max(1.0, self._left()))
                        self._stop_targets[stream] = info.state.last_seq
                    except Exception as exc:  # noqa: BLE001 - NATS trouble: ask again until the bound
                        log.debug("%s: stream info on stop failed: %s", stream, exc)
                        if self._left() <= 0:
                            break
                        await asyncio.sleep(min(0.5, self._left()))
        finally:
            self._stop_targets_read.set()

    async def _up_to_stop_target(self, msgs: list[Msg]) -> list[Msg]:
        """After a stop, LB_OUT only up to its target (``_plan_stop``); the rest is neither
        committed nor acked: the stream keeps it for the next start."""
        await self._stop_targets_read.wait()
        target = self._stop_targets.get(sj.OUT_STREAM)
        if target is None:
            return msgs
        return [msg for msg in msgs if parse_ack_subject(msg.reply).stream_seq <= target]

    def _begin_stop(self) -> None:
        if not self._stop_deadline:
            self._stop_deadline = time.monotonic() + self.options.stop_catch_up_s

    def _left(self) -> float:
        return self._stop_deadline - time.monotonic()

    def _keep_reading(self, stream: str, stop: asyncio.Event) -> bool:
        """Pull again: always while running; after a stop, until the stream's target is recorded
        (or while it is not yet known), within the catch-up bound."""
        if not stop.is_set():
            return True
        self._begin_stop()
        if self._left() <= 0:
            return False
        target = self._stop_targets.get(stream)
        return target is None or self.recorded_through[stream] < target

    def _log_short(self) -> None:
        """One line per stream the stop left short of its target (module header, "Stop")."""
        for stream in self.stats:
            target, done = self._stop_targets.get(stream), self.recorded_through[stream]
            if target is None:
                log.warning("stopping: %s's last seq could not be read (NATS trouble); recorded through seq %d",
                            stream, done)
            elif target is not None and done < target:
                log.warning("stopping after --stop-catch-up-s %g with %s seqs %d..%d not recorded (%d messages; "
                            "the stream keeps them, the next start records them)", self.options.stop_catch_up_s,
                            stream, done + 1, target, target - done)

    async def _open(self, reader: PullReader) -> None:
        """(Re)create the stream's durable consumer at the database's position: the file, not the
        consumer's ack state, decides where recording resumes (messages delivered to a killed
        recorder are delivered again at once instead of after the ack wait)."""
        suffix = "events" if reader.stream == sj.EVENTS_STREAM else "out"
        await reader.open(ack_all_consumer(self.recorded_through[reader.stream] + 1, max_deliver=-1,
                                           durable_name=f"{self.options.durable}-{suffix}"))

    async def _recover(self, reader: PullReader, stop: asyncio.Event) -> None:
        """The consumer is gone or unusable (deleted by hand, leadership change): recreate it
        from the database's position, slowly, until that works (after a stop, within its bound)."""
        log.warning("%s: pull failed (%s); recreating consumer %s from seq %d", reader.stream, reader.gone,
                    reader.consumer, self.recorded_through[reader.stream] + 1)
        await asyncio.sleep(min(1.0, max(0.0, self._left())) if stop.is_set() else 1.0)
        try:
            if stop.is_set():
                await asyncio.wait_for(self._open(reader), max(0.1, self._left()))
            else:
                await self._open(reader)
        except Exception as exc:  # noqa: BLE001 - NATS trouble: try again after the next pull
            log.warning("%s: could not recreate the consumer: %s", reader.stream, exc)

    async def _commit(self, stream: str, msgs: list[Msg]) -> Msg | None:
        """Insert one batch (plus any seq missing before its highest); returns the message to
        ack, or None when a missing seq could not be fetched (then nothing may be acked past it:
        the rows are kept, and the next batch tries the hole again)."""
        assert self.con is not None
        started = time.perf_counter()
        rows = store.Columns(stream)
        highest, top = msgs[0], 0
        start, written = self.recorded_through[stream] + 1, self.written_above[stream]
        for msg in msgs:
            info = parse_ack_subject(msg.reply)
            seq = info.stream_seq
            if seq > top:
                highest, top = msg, seq
            if seq < start or seq in written:  # in the file already (a redelivery)
                continue
            rows.append(seq, info.ts_ns, msg.subject, msg.data)
            written.add(seq)  # taken back below if the write fails
        complete, wrote = True, False
        try:
            if not is_contiguous(rows.seq, start, top) and not all(seq in written for seq in range(start, top + 1)):
                try:
                    await self._fill(stream, start, top, rows, written)
                except Exception as exc:  # noqa: BLE001 - NATS trouble: keep the rows, do not ack
                    log.warning("%s: could not fetch missing seqs in %d..%d (%s); not acking yet", stream, start, top,
                                exc)
                    complete = False
            wrote = await self._write(stream, rows)
        finally:
            if not wrote:  # not in the file (given up at a stop, or an error on its way up)
                written.difference_update(rows.seq)
        if not wrote:
            return None
        written.update(rows.seq)  # the seqs _fill added
        stats = self.stats[stream]
        stats.recorded += len(rows)  # rows committed: a redelivered message is not one
        stats.batches += 1
        stats.batch_seconds.observe(time.perf_counter() - started)
        if not complete:
            return None
        self.recorded_through[stream] = through = max(self.recorded_through[stream], top)
        self.written_above[stream] = {seq for seq in written if seq > through}
        return highest

    async def _write(self, stream: str, rows: store.Columns) -> bool:
        """Commit ``rows``; a commit DuckDB refuses (a full disk: the WAL or the file cannot grow;
        the transaction is rolled back, the file stays whole) is tried again, 0.5 s doubling to
        ``WRITE_RETRY_MAX_S``, nothing acked meanwhile (JetStream keeps the messages), said in the
        log and in ``laswrr_recorder_write_failures`` / ``laswrr_recorder_write_failing``. False
        when a stop's catch-up bound ran out first (the stream keeps the rest)."""
        stats, failures = self.stats[stream], 0
        while True:
            try:
                if self._reopen_needed:  # invalidated by a fatal error, and not opened again yet
                    await self._db(self._reopen)
                    if await self._db(store.has_rows, self.con, stream, rows.seq):
                        break  # the commit before the fatal error had landed
                await self._db(store.insert_rows, self.con, [rows])
            except (duckdb.IOException, duckdb.TransactionException, duckdb.OutOfMemoryException,
                    duckdb.FatalException, duckdb.ConnectionException, store.StoreError) as exc:
                raised = self.memory_raised
                if await self._db(self._recover_writer, exc, stream, rows.seq):
                    break  # committed before DuckDB failed its checkpoint
                if self.memory_raised > raised and not self._reopen_needed:
                    continue  # the limit was raised: again at once
                failures += 1
                stats.write_failures += 1
                stats.failing = True
                if failures == 1 or failures % 20 == 0:
                    log.error("%s: cannot write to %s (%s); recording paused, nothing acked (the stream keeps "
                              "the messages), trying again (attempt %d)", stream, self.options.db_path,
                              store.first_line(exc), failures)
                if self._stop_deadline and self._left() <= 0:
                    return False
                await asyncio.sleep(min(WRITE_RETRY_MAX_S, 0.5 * 2 ** (failures - 1)))
                continue
            break
        if stats.failing:
            stats.failing = False
            log.warning("%s: writing to %s again after %d failed attempt(s)", stream, self.options.db_path, failures)
        return True

    def _recover_writer(self, exc: BaseException, stream: str, seqs: list[int]) -> bool:
        """After a failed write (in the DuckDB thread, under the lock): whether ``seqs`` are in
        the file all the same. Out of memory under our limit: the limit is doubled (DuckDB pins
        what it wrote since its last checkpoint, and one commit of large payloads can need more
        than a small pool's; docs/evidence/soak.md). A fatal error (DuckDB failed its
        checkpoint after a durable commit) invalidates the connection: it is opened again (or,
        if that fails too, before the next try). The rows are then looked for, so a commit that
        did land is neither lost nor written twice."""
        raised = store.out_of_memory(exc) and 0 < self.memory_limit_mb < MEMORY_LIMIT_MAX_MB
        if raised:
            self.memory_limit_mb *= 2
            self.memory_raised += 1
            log.warning("%s: DuckDB needed more memory than its limit (%s); limit raised to %d MB", stream,
                        store.first_line(exc), self.memory_limit_mb)
        if isinstance(exc, duckdb.FatalException):
            self._reopen_needed = True
            log.warning("%s: DuckDB's fatal error invalidated %s (%s); opening it again", stream,
                        self.options.db_path, store.first_line(exc))
        if self._reopen_needed:
            try:
                self._reopen()
            except (duckdb.Error, store.StoreError) as again:
                log.error("%s: cannot open %s again (%s)", stream, self.options.db_path, store.first_line(again))
                return False
        elif raised:
            assert self.con is not None
            store.set_memory_limit(self.con, self.memory_limit_mb)
        else:
            return False  # a refused commit (a full disk): rolled back, nothing written
        assert self.con is not None
        return store.has_rows(self.con, stream, seqs)

    def _reopen(self) -> None:
        """Open the log again after a fatal error (the old connection is unusable); raises when it cannot."""
        if self.con is not None:
            with contextlib.suppress(duckdb.Error):
                self.con.close()
            self.con = None
        self.con = store.open_writer(self.options.db_path, self.memory_limit_mb or None)
        self._reopen_needed = False
        log.warning("reopened %s (DuckDB memory limit %s)", self.options.db_path,
                    f"{self.memory_limit_mb} MB" if self.memory_limit_mb else "DuckDB's own")

    # -- holes ----------------------------------------------------------------------------------

    async def _fill(self, stream: str, start: int, top: int, rows: store.Columns,
                    written: set[int] | frozenset[int] = frozenset()) -> None:
        """Fetch seqs start..top that neither ``rows`` nor the file (``written``) has directly
        from the stream (module header)."""
        first = (await self.js.stream_info(stream)).state.first_seq
        if start < first:
            log.warning("%s seqs %d..%d were dropped by retention before they were recorded", stream, start, first - 1)
        present = set(rows.seq) | written
        stats = self.stats[stream]
        for seq in range(max(start, first), top + 1):
            if seq in present:
                continue
            got = await self._get_msg(stream, seq)
            if got is None:
                stats.gaps += 1
                log.warning("%s seq %d is not in the stream (deleted?): recorded as a gap", stream, seq)
                continue
            rows.append(*got)
            stats.repaired += 1

    async def _get_msg(self, stream: str, seq: int) -> tuple[int, int, str, bytes] | None:
        envelope = await get_envelope(self.nc, stream, seq)
        if envelope is None:
            return None
        return seq, envelope.ts_ns, envelope.subject, envelope.data

    async def _repair_holes(self, stream: str) -> None:
        """Once at start: seqs missing inside the recorded range (an older crash) are fetched."""
        assert self.con is not None
        holes = await self._db(find_holes, self.con, stream)
        rows = store.Columns(stream)
        for start, end in holes:
            await self._fill(stream, start, end, rows)
        if len(rows):
            await self._db(store.insert_rows, self.con, [rows])
            log.info("%s: filled %d hole(s) in the recorded range", stream, len(rows))


def is_contiguous(seqs: list[int], start: int, top: int) -> bool:
    """True when ``seqs`` holds every seq start..top (the usual batch: exactly that, in order)."""
    if top < start:
        return True
    if len(seqs) == top - start + 1 and seqs[0] == start and seqs[-1] == top:
        return True
    return len(set(s for s in seqs if s >= start)) == top - start + 1


def find_holes(con: duckdb.DuckDBPyConnection, stream: str) -> list[tuple[int, int]]:
    """Ranges of seqs missing between the lowest and highest recorded seq of ``stream``."""
    row = con.execute("SELECT min(seq), max(seq), count(*) FROM events WHERE stream = ?", [stream]).fetchone()
    if not row or row[2] == 0 or row[1] - row[0] + 1 == row[2]:
        return []
    rows = con.execute(
        "SELECT seq + 1, next_seq - 1 FROM (SELECT seq, lead(seq) OVER (ORDER BY seq) AS next_seq "
        "FROM events WHERE stream = ?) WHERE next_seq > seq + 1 ORDER BY seq", [stream]).fetchall()
    return [(int(a), int(b)) for a, b in rows]


# -- /metrics (services/service_metrics.py) ------------------------------------------------------


async def render_metrics(recorder: Recorder) -> bytes:
    """The counters as they are now, then the lag behind the seqs recorded at that moment (the
    look-ups yield to the batch loops, which may move on meanwhile)."""
    recorded = dict(recorder.recorded_through)
    families = list(_families(recorder, recorded))
    lag_n = GaugeMetricFamily("laswrr_recorder_lag_messages", "Messages not yet recorded", labels=["stream"])
    lag_s = GaugeMetricFamily("laswrr_recorder_lag_seconds", "Age of the oldest message not yet recorded",
                              labels=["stream"])
    for stream, seq in recorded.items():
        behind, behind_s = await lag(recorder.js, stream, seq)
        lag_n.add_metric([stream], behind)
        lag_s.add_metric([stream], behind_s)
    return render(lambda: iter([*families, lag_n, lag_s]))


def _families(recorder: Recorder, recorded: dict[str, int]) -> Iterator[Metric]:
    labels = ["stream"]
    families = {
        "rows_written": CounterMetricFamily("laswrr_recorder_rows_written", "Rows committed to DuckDB", labels=labels),
        "batches": CounterMetricFamily("laswrr_recorder_batches", "Batches committed", labels=labels),
        "repaired": CounterMetricFamily("laswrr_recorder_repaired", "Missing seqs fetched from the stream", labels=labels),
        "gaps": CounterMetricFamily("laswrr_recorder_gaps", "Seqs the stream no longer had", labels=labels),
        "write_failures": CounterMetricFamily("laswrr_recorder_write_failures",
                                              "Commits DuckDB refused (a full disk), retried", labels=labels),
        "failing": GaugeMetricFamily("laswrr_recorder_write_failing",
                                     "1 while the last commit failed (recording paused, nothing acked)", labels=labels),
        "seq": GaugeMetricFamily("laswrr_recorder_recorded_seq", "Highest seq recorded without a hole", labels=labels),
    }
    batch = HistogramMetricFamily("laswrr_recorder_batch_seconds", "One commit (insert, fill holes)", labels=labels)
    for stream, stats in recorder.stats.items():
        for key, value in (("rows_written", stats.recorded), ("batches", stats.batches), ("repaired", stats.repaired),
                           ("gaps", stats.gaps), ("write_failures", stats.write_failures),
                           ("failing", int(stats.failing)), ("seq", recorded[stream])):
            families[key].add_metric([stream], value)
        batch.add_metric([stream], stats.batch_seconds.exposition(), stats.batch_seconds.total)
    yield from families.values()
    yield batch
    limit = GaugeMetricFamily("laswrr_recorder_memory_limit_bytes", "DuckDB's memory limit on the writer in force "
                              "(--memory-limit-mb, raised when a commit needed more); 0: DuckDB's own")
    limit.add_metric([], recorder.memory_limit_mb << 20)
    yield limit


# -- command line ---------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("recorder", help="record LB_EVENTS and LB_OUT into DuckDB",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    settings.add_nats_options(parser)
    parser.add_argument("--data-dir", default=str(RecorderOptions.data_dir), metavar="DIR",
                        help=f"the log goes to DIR/{store.DB_FILE} (default %(default)s)")
    parser.add_argument("--batch", type=int, default=RecorderOptions.batch, metavar="N",
                        help="messages per batch (default %(default)s)")
    parser.add_argument("--flush-ms", type=settings.duration("ms"), default=RecorderOptions.flush_ms, metavar="MS",
                        help="longest wait for a batch to fill before committing (default %(default)s)")
    parser.add_argument("--idle-flush-ms", type=settings.duration("ms"), default=RecorderOptions.idle_flush_ms,
                        metavar="MS", help="while a stream trickles (at most 10 messages a second), each wait is "
                                           "twice the last, up to MS, until one brings more (default %(default)s; "
                                           "at most --flush-ms: off)")
    parser.add_argument("--durable", default=RecorderOptions.durable, metavar="NAME",
                        help="consumer name prefix (default %(default)s: NAME-events, NAME-out)")
    parser.add_argument("--stop-catch-up-s", type=settings.duration("s"), default=RecorderOptions.stop_catch_up_s,
                        metavar="S", help="on SIGTERM/SIGINT, keep recording up to the streams' last seqs as of "
                                          "the stop for at most S, then log what is left (default %(default)s; "
                                          "0: stop at once)")
    parser.add_argument("--memory-limit-mb", type=int, default=RecorderOptions.memory_limit_mb, metavar="MB",
                        help="DuckDB's memory limit on the log's writer, at start: past it DuckDB evicts the "
                             "blocks it keeps cached (read back from the file when needed), so the recorder's RSS "
                             "stops growing with the file; a commit or checkpoint that needs more (large "
                             "snapshots, a backlog) doubles it, up to half the host's memory, and the batch is written once all the same "
                             "(docs/evidence/soak.md) (default %(default)s; 0: DuckDB's own limit, 80 %% of RAM)")
    settings.add_stream_replicas(parser)
    settings.add_metrics_port(parser)
    settings.add_logging(parser)
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    settings.configure_logging(args, "recorder")
    if args.batch < 1 or args.flush_ms < 1 or args.memory_limit_mb < 0:
        print("laswrr recorder: --batch and --flush-ms must be >= 1, --memory-limit-mb >= 0", file=sys.stderr)
        return 2
    options = RecorderOptions(data_dir=Path(args.data_dir), batch=args.batch, flush_ms=args.flush_ms,
                              idle_flush_ms=args.idle_flush_ms,
                              durable=args.durable, stream_replicas=args.stream_replicas,
                              stop_catch_up_s=args.stop_catch_up_s, memory_limit_mb=args.memory_limit_mb)
    return asyncio.run(serve(args.nats_url, options, args.metrics_port, settings.nats_auth(args)))


async def serve(nats_url: str, options: RecorderOptions, metrics_port: int | None = None,
                auth: NatsAuth | None = None) -> int:
    stop = settings.stop_event()
    try:
        nc = await connect(nats_url, "laswrr-recorder", auth)
    except Exception as exc:  # noqa: BLE001
        log.error("cannot connect to %s: %s", redact_url(nats_url), exc)
        return 1
    started = time.monotonic()
    recorder = Recorder(nc, options)
    runner = None
    try:
        if metrics_port is not None:
            runner = await serve_metrics(metrics_port, lambda: render_metrics(recorder), service="recorder")
        await recorder.run(stop)
    except store.StoreError as exc:
        log.error("%s", exc)
        return 1
    finally:
        if runner is not None:
            await runner.cleanup()
        with contextlib.suppress(Exception):  # bounded: a drain with NATS gone would wait for ever
            await asyncio.wait_for(nc.drain(), 10)
    log.debug("ran %.1f s", time.monotonic() - started)
    return 0
