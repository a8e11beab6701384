"""`laswrr recorder`: every message of LB_EVENTS and LB_OUT, exactly once, into DuckDB.

Theory of operation.

* **Durable pull consumers, AckAll.** One durable consumer per stream (``<durable>-events``,
  ``<durable>-out``; ack policy ``all``, no ack-pending limit), recreated at start from the
  database's highest recorded seq + 1: the file, not the consumer, says where to resume. Each is read with
  raw ``$JS.API.CONSUMER.MSG.NEXT`` requests (``batch`` messages or ``flush_ms`` of waiting,
  whichever comes first) into a callback subscription: nats-py's ``fetch`` waits on every
  message separately and tops out near 35,000 msg/s here; the callback path is much faster.
* **Commit, then ack.** A batch becomes one row per message — ``(stream, stream seq, ts_ns,
  subject, data)`` with ``ts_ns`` the exact JetStream timestamp from the ack subject (the same
  time the scheduler used) and ``data`` the payload text as it came, malformed or not — inserted
  in one transaction with ``ON CONFLICT DO NOTHING``; only then is the batch's highest message
  acked, which (AckAll) acknowledges everything before it. A crash before the ack means
  redelivery, and redelivered rows are skipped: none lost, none duplicated.
* **No silent holes.** Acking seq S also acknowledges every earlier message, including one that
  was delivered but lost on the way (a reconnect). So before acking, any seq missing between the
  last recorded one and S is fetched directly from the stream (``STREAM.MSG.GET``); a seq the
  stream no longer has (deleted, or dropped by retention) is logged as a gap, and the same
  check runs once over the whole file at start.
* **Pipelining.** The next pull request is in flight while a batch is committed in a worker
  thread; one lock serialises every use of the DuckDB connection.
* **One writer per DuckDB file** (design §8). Readers (``laswrr replay|report|export --db``)
  that find the file locked send a request on ``lb.recorder.snapshot`` (``{"db": path, "to":
  path}``); the recorder that owns ``db`` pauses committing LB_OUT, records LB_EVENTS up to the
  stream's last seq at the time of the request (so every recorded output has its input),
  copies the database into ``to`` with DuckDB's ``COPY FROM DATABASE`` and replies ``{"path": to}`` (or ``{"error": ...}``).
  A recorder that does not own ``db`` stays silent.
* **Stop.** SIGINT/SIGTERM: finish the pull in flight, commit, ack, drain the connection, close
  the database, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from replay import store
from schemas import subjects as sj
from services import settings
from services.natsbus import connect, ensure_streams
from services.scheduler_service import parse_ack_subject

log = logging.getLogger("laswrr.recorder")

STATUS_DONE = {"404", "408", "409", "503"}  # no messages / expired / ended / no responders
STATUS_BROKEN = {"409", "503"}  # consumer deleted, leadership change, ... / consumer gone
SNAPSHOT_SUBJECT = store.SNAPSHOT_SUBJECT


@dataclass
class RecorderOptions:
    data_dir: Path = Path(settings.DEFAULT_DATA_DIR)
    batch: int = 5000
    flush_ms: int = 200
    durable: str = "recorder"

    @property
    def db_path(self) -> Path:
        return self.data_dir / store.DB_FILE


@dataclass
class StreamStats:
    recorded: int = 0
    batches: int = 0
    repaired: int = 0
    gaps: int = 0


def parse_rfc3339_ns(text: str) -> int:
    """``2024-05-01T10:00:00.123456789Z`` -> integer ns since the epoch (no float rounding)."""
    text = text.strip().replace("z", "Z")
    offset = datetime.timedelta(0)
    if not text.endswith("Z"):
        sign = 1 if text[-6] == "+" else -1
        offset = sign * datetime.timedelta(hours=int(text[-5:-3]), minutes=int(text[-2:]))
        text = text[:-6]
    else:
        text = text[:-1]
    whole, _, fraction = text.partition(".")
    base = datetime.datetime.strptime(whole, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=datetime.timezone.utc)
    seconds = int((base - offset).timestamp())
    return seconds * 1_000_000_000 + int((fraction or "0")[:9].ljust(9, "0"))


def payload_text(data: bytes) -> str:
    """The payload as text; bytes that are not UTF-8 become U+FFFD (DuckDB VARCHAR is UTF-8)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("utf-8", "replace")


class PullConsumer:
    """A durable AckAll pull consumer read with raw pull requests into a callback buffer.

    Every delivered message lands in the buffer, whichever request it answered (a late one
    after a reconnect is still a delivery we must record before acking past it); a status
    message ends a request only when it answers the current one.
    """

    def __init__(self, nc: Client, stream: str, durable: str) -> None:
        self.nc, self.stream, self.durable = nc, stream, durable
        self._inbox = ""
        self._request = 0
        self._current = ""
        self._want = 0
        self._buffer: list[Msg] = []
        self._done = asyncio.Event()
        self._sub: Any = None
        self.failure: str | None = None  # why the last pull ended without working, if it did

    async def start(self, js: JetStreamContext, from_seq: int) -> None:
        """(Re)create the durable consumer at ``from_seq``: the database, not the consumer's ack
        state, decides where recording resumes (messages delivered to a killed recorder are
        delivered again at once instead of after the ack wait)."""
        with contextlib.suppress(NotFoundError):
            await js.delete_consumer(self.stream, self.durable)
        config = ConsumerConfig(durable_name=self.durable, deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                opt_start_seq=max(1, from_seq), ack_policy=AckPolicy.ALL, ack_wait=60.0,
                                max_ack_pending=-1, max_deliver=-1)
        await js.add_consumer(self.stream, config)
        if self._sub is None:
            self._inbox = self.nc.new_inbox()
            self._sub = await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_msg)
        self.failure = None

    async def _on_msg(self, msg: Msg) -> None:
        if not msg.data and msg.headers and "Status" in msg.headers:
            status = msg.headers["Status"]
            if msg.subject == self._current and status in STATUS_DONE:
                if status in STATUS_BROKEN:
                    self.failure = f"{status} {msg.headers.get('Description', '')}".strip()
                self._done.set()
            return
        self._buffer.append(msg)
        if len(self._buffer) >= self._want:
            self._done.set()

    async def fetch(self, batch: int, wait_ms: int) -> list[Msg]:
        """Up to ``batch`` messages, waiting at most ``wait_ms`` for them to arrive."""
        if len(self._buffer) < batch:
            self._request += 1
            self._current = f"{self._inbox}.{self._request}"
            self._want = batch
            self._done.clear()
            body = json.dumps({"batch": batch - len(self._buffer), "expires": wait_ms * 1_000_000}).encode()
            await self.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.durable}", body,
                                  reply=self._current)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._done.wait(), wait_ms / 1000 + 5.0)
            self._current = ""
        taken, self._buffer = self._buffer, []
        return taken


class Recorder:
    """``await run(stop)`` records both streams until ``stop`` is set."""

    def __init__(self, nc: Client, options: RecorderOptions) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.options = options
        self.con: duckdb.DuckDBPyConnection | None = None
        self.stats = {sj.EVENTS_STREAM: StreamStats(), sj.OUT_STREAM: StreamStats()}
        self.recorded_through = {sj.EVENTS_STREAM: 0, sj.OUT_STREAM: 0}
        self.ready = asyncio.Event()
        self._db_lock = asyncio.Lock()
        self._out_gate = asyncio.Event()  # cleared while a snapshot copy waits for LB_EVENTS
        self._out_gate.set()
        self._snapshots: list[tuple[int, Path, asyncio.Future[dict[str, str]]]] = []

    # -- lifecycle ------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        self.con = await asyncio.to_thread(store.open_writer, self.options.db_path)
        try:
            await self._ensure_streams()
            for stream in self.stats:
                first = (await self.js.stream_info(stream)).state.first_seq
                recorded = await self._db(store.max_seq, self.con, stream)
                if recorded and first - 1 > recorded:
                    log.warning("%s seqs %d..%d were dropped by retention before they were recorded",
                                stream, recorded + 1, first - 1)
                self.recorded_through[stream] = max(recorded, first - 1)
                await self._repair_holes(stream)
            pullers = [PullConsumer(self.nc, stream, f"{self.options.durable}-{suffix}")
                       for stream, suffix in ((sj.EVENTS_STREAM, "events"), (sj.OUT_STREAM, "out"))]
            for puller in pullers:
                await puller.start(self.js, self.recorded_through[puller.stream] + 1)
            await self.nc.subscribe(SNAPSHOT_SUBJECT, cb=self._on_snapshot_request)
            log.info("recording %s into %s (batch %d, flush %d ms)", ", ".join(self.stats),
                     self.options.db_path, self.options.batch, self.options.flush_ms)
            self.ready.set()
            await asyncio.gather(*(self._record(puller, stop) for puller in pullers))
        finally:
            for _, _, future in self._snapshots:
                if not future.done():
                    future.set_result({"error": "recorder stopping"})
            await asyncio.to_thread(self.con.close)
            self.con = None
            log.info("stopped: %s", ", ".join(f"{s} {st.recorded} rows" for s, st in self.stats.items()))

    async def _ensure_streams(self) -> None:
        """Create missing streams with defaults; never change the limits of existing ones."""
        for stream in self.stats:
            try:
                await self.js.stream_info(stream)
            except NotFoundError:
                await ensure_streams(self.js)
                return

    async def _db(self, fn: Any, *args: Any) -> Any:
        async with self._db_lock:
            return await asyncio.to_thread(fn, *args)

    # -- the batch loop -------------------------------------------------------------------------

    async def _record(self, puller: PullConsumer, stop: asyncio.Event) -> None:
        stream = puller.stream
        pending: asyncio.Task[list[Msg]] | None = None
        while True:
            msgs = await (pending or puller.fetch(self.options.batch, self.options.flush_ms))
            pending = None
            if not stop.is_set():
                pending = asyncio.create_task(puller.fetch(self.options.batch, self.options.flush_ms))
            if not msgs and puller.failure is not None:
                await self._recover(puller)
            if msgs:
                if stream == sj.OUT_STREAM:
                    await self._out_gate.wait()
                highest = await self._commit(stream, msgs)
                if highest is not None:
                    with contextlib.suppress(Exception):  # a lost ack only means a redelivery
                        await highest.ack()  # AckAll: acknowledges every message up to this one
            if stream == sj.EVENTS_STREAM:
                await self._serve_snapshots(final=pending is None)
            if pending is None:
                return

    async def _recover(self, puller: PullConsumer) -> None:
        """The consumer is gone or unusable (deleted by hand, leadership change): recreate it
        from the database's position, slowly, until that works."""
        log.warning("%s: pull failed (%s); recreating consumer %s from seq %d", puller.stream, puller.failure,
                    puller.durable, self.recorded_through[puller.stream] + 1)
        await asyncio.sleep(1.0)
        try:
            await puller.start(self.js, self.recorded_through[puller.stream] + 1)
        except Exception as exc:  # noqa: BLE001 - NATS trouble: try again after the next pull
            log.warning("%s: could not recreate the consumer: %s", puller.stream, exc)

    async def _commit(self, stream: str, msgs: list[Msg]) -> Msg | None:
        """Insert one batch (plus any seq missing before its highest); returns the message to
        ack, or None when a missing seq could not be fetched (then nothing may be acked past it:
        the rows are kept, and the next batch tries the hole again)."""
        assert self.con is not None
        rows = store.Columns(stream)
        highest, top = msgs[0], 0
        for msg in msgs:
            info = parse_ack_subject(msg.reply)
            rows.append(info.stream_seq, info.ts_ns, msg.subject, payload_text(msg.data))
            if info.stream_seq > top:
                highest, top = msg, info.stream_seq
        start = self.recorded_through[stream] + 1
        complete = True
        if not is_contiguous(rows.seq, start, top):
            try:
                await self._fill(stream, start, top, rows)
            except Exception as exc:  # noqa: BLE001 - NATS trouble: keep the rows, do not ack
                log.warning("%s: could not fetch missing seqs in %d..%d (%s); not acking yet", stream, start, top, exc)
                complete = False
        await self._db(store.insert_rows, self.con, [rows])
        stats = self.stats[stream]
        stats.recorded += len(msgs)
        stats.batches += 1
        if not complete:
            return None
        self.recorded_through[stream] = max(self.recorded_through[stream], top)
        return highest

    # -- holes ----------------------------------------------------------------------------------

    async def _fill(self, stream: str, start: int, top: int, rows: store.Columns) -> None:
        """Fetch seqs start..top that ``rows`` lacks directly from the stream (module header)."""
        first = (await self.js.stream_info(stream)).state.first_seq
        if start < first:
            log.warning("%s seqs %d..%d were dropped by retention before they were recorded", stream, start, first - 1)
        present = set(rows.seq)
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

    async def _get_msg(self, stream: str, seq: int) -> tuple[int, int, str, str] | None:
        reply = await self.nc.request(f"$JS.API.STREAM.MSG.GET.{stream}", json.dumps({"seq": seq}).encode(),
                                      timeout=5.0)
        answer = json.loads(reply.data)
        message = answer.get("message")
        if not message:
            return None
        data = base64.b64decode(message.get("data") or "")
        return seq, parse_rfc3339_ns(message["time"]), message["subject"], payload_text(data)

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

    # -- live copies for readers ----------------------------------------------------------------

    async def _on_snapshot_request(self, msg: Msg) -> None:
        try:
            request = json.loads(msg.data)
            owner = Path(request["db"]).resolve() == self.options.db_path.resolve()
            target = Path(request["to"])
        except (ValueError, KeyError, TypeError):
            await msg.respond(json.dumps({"error": "request must be {\"db\": path, \"to\": path}"}).encode())
            return
        if not owner:
            return  # another recorder's file: let its owner answer
        if target.exists() or not target.parent.is_dir():
            await msg.respond(json.dumps({"error": f"{target} exists or its directory does not"}).encode())
            return
        self._out_gate.clear()
        async with self._db_lock:  # a LB_OUT commit in progress ends before we read the target
            pass
        last = (await self.js.stream_info(sj.EVENTS_STREAM)).state.last_seq
        future: asyncio.Future[dict[str, str]] = asyncio.get_running_loop().create_future()
        self._snapshots.append((last, target, future))
        reply = await future
        with contextlib.suppress(Exception):
            await msg.respond(json.dumps(reply).encode())

    async def _serve_snapshots(self, final: bool = False) -> None:
        ready = [s for s in self._snapshots if final or self.recorded_through[sj.EVENTS_STREAM] >= s[0]]
        for item in ready:
            self._snapshots.remove(item)
            _, target, future = item
            try:
                await self._db(copy_database, self.con, target)
                future.set_result({"path": str(target)})
                log.info("copied the log to %s for a reader", target)
            except Exception as exc:  # noqa: BLE001 - reported to the reader, never fatal here
                future.set_result({"error": f"copy failed: {exc}"})
        if not self._snapshots:
            self._out_gate.set()


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


def copy_database(con: duckdb.DuckDBPyConnection, target: Path) -> None:
    """Copy the whole database into a new file at ``target`` through DuckDB itself.

    Never open the live file a second time from this process (e.g. ``shutil.copyfile``): POSIX
    record locks are per process, and closing any descriptor of the file drops the write lock
    that keeps other processes out.
    """
    literal = str(target).replace("'", "''")
    source = con.execute("SELECT current_database()").fetchone()
    assert source is not None
    con.execute(f"ATTACH '{literal}' AS laswrr_copy")
    try:
        con.execute(f'COPY FROM DATABASE "{source[0]}" TO laswrr_copy')
    finally:
        con.execute("DETACH laswrr_copy")


# -- command line ---------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("recorder", help="record LB_EVENTS and LB_OUT into DuckDB",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    settings.add_nats_url(parser)
    parser.add_argument("--data-dir", default=settings.DEFAULT_DATA_DIR, metavar="DIR",
                        help=f"the log goes to DIR/{store.DB_FILE} (default {settings.DEFAULT_DATA_DIR})")
    parser.add_argument("--batch", type=int, default=5000, metavar="N", help="messages per batch (default 5000)")
    parser.add_argument("--flush-ms", type=int, default=200, metavar="MS",
                        help="longest wait for a batch to fill before committing (default 200)")
    parser.add_argument("--durable", default="recorder", metavar="NAME",
                        help="consumer name prefix (default recorder: NAME-events, NAME-out)")
    settings.add_verbosity(parser)
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    settings.configure_logging(args.verbose, "recorder")
    if args.batch < 1 or args.flush_ms < 1:
        print("laswrr recorder: --batch and --flush-ms must be >= 1", file=sys.stderr)
        return 2
    options = RecorderOptions(data_dir=Path(args.data_dir), batch=args.batch, flush_ms=args.flush_ms,
                              durable=args.durable)
    return asyncio.run(serve(args.nats_url, options))


async def serve(nats_url: str, options: RecorderOptions) -> int:
    stop = settings.stop_event()
    try:
        nc = await connect(nats_url, "laswrr-recorder")
    except Exception as exc:  # noqa: BLE001
        log.error("cannot connect to %s: %s", nats_url, exc)
        return 1
    started = time.monotonic()
    try:
        await Recorder(nc, options).run(stop)
    except store.StoreError as exc:
        log.error("%s", exc)
        return 1
    finally:
        with contextlib.suppress(Exception):
            await nc.drain()
    log.debug("ran %.1f s", time.monotonic() - started)
    return 0
