"""Consistent copies of a DuckDB file a running recorder holds: both ends of ``lb.recorder.snapshot``.

One writer per DuckDB file (docs/design.md, "Hazards designed for"): a reader (``laswrr
replay|report|export --db``, the dashboard) that finds the file locked asks for a copy with
``copy_from_recorder`` (the request side: ``{"db": path, "to": path}`` on
``lb.recorder.snapshot``, blocking, as ``store.open_read``'s ``copy_locked``).

The reply side is ``CopyDesk``, which the recorder (services/recorder.py) owns. The recorder that
owns ``db`` answers; any other stays silent. ``to`` must be a new file inside the recorder's
data directory (symbolic links resolved), anything else is refused with the reason. For an
accepted request the desk closes ``gate`` (the recorder stops committing LB_OUT), notes LB_EVENTS'
last seq at the time of the request, and, once the recorder has recorded LB_EVENTS that far
(``serve``, called from its LB_EVENTS loop), copies the database into ``to`` with DuckDB's
``COPY FROM DATABASE`` (so every recorded output in the copy has its input) and replies
``{"path": to}``, or ``{"error": ...}``; then it opens the gate again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import duckdb
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from laswrr.replay import store
from laswrr.schemas import subjects as sj
from laswrr.services.natsbus import NatsAuth, connect, redact_url

log = logging.getLogger("laswrr.recorder")

RunDb = Callable[..., Awaitable[Any]]  # the recorder's ``_db``: fn(con, *args) in a thread, under its lock


class CopyDesk:
    """The recorder's side of ``lb.recorder.snapshot`` (module header)."""

    def __init__(self, db_path: Path, data_dir: Path, js: JetStreamContext, run_db: RunDb, db_lock: asyncio.Lock,
                 connection: Callable[[], duckdb.DuckDBPyConnection | None],
                 memory_limit_mb: Callable[[], int] = lambda: 0) -> None:
        self.db_path, self.data_dir, self.js = db_path, data_dir, js
        self._run_db, self._db_lock, self._connection = run_db, db_lock, connection
        self._memory_limit_mb = memory_limit_mb  # the writer's DuckDB limit in force (0: DuckDB's own)
        self.gate = asyncio.Event()  # cleared while a copy waits for LB_EVENTS: LB_OUT commits wait
        self.gate.set()
        self.pending: list[tuple[int, Path, asyncio.Future[dict[str, str]]]] = []

    async def on_request(self, msg: Msg) -> None:
        try:
            request = json.loads(msg.data)
            owner = Path(request["db"]).resolve() == self.db_path.resolve()
            target = Path(request["to"])
        except (ValueError, KeyError, TypeError):
            await msg.respond(json.dumps({"error": "request must be {\"db\": path, \"to\": path}"}).encode())
            return
        if not owner:
            return  # another recorder's file: let its owner answer
        refused = self.refuse_target(target)
        if refused is not None:
            log.warning("refused a copy request: %s", refused)
            await msg.respond(json.dumps({"error": refused}).encode())
            return
        self.gate.clear()
        async with self._db_lock:  # a LB_OUT commit in progress ends before we read the target
            pass
        last = (await self.js.stream_info(sj.EVENTS_STREAM)).state.last_seq
        future: asyncio.Future[dict[str, str]] = asyncio.get_running_loop().create_future()
        self.pending.append((last, target, future))
        reply = await future
        with contextlib.suppress(Exception):
            await msg.respond(json.dumps(reply).encode())

    def refuse_target(self, target: Path) -> str | None:
        """Why a copy may not be written at ``target`` (None: it may). Copies go only inside the
        data directory (symbolic links resolved), never over an existing file."""
        home = self.data_dir.resolve()
        resolved = target.resolve()
        if not resolved.is_relative_to(home) or resolved == home:
            return f"{target} is not inside the recorder's data directory {home}"
        if resolved.exists() or not resolved.parent.is_dir():
            return f"{target} exists or its directory does not"
        return None

    async def serve(self, events_recorded_through: int, final: bool = False) -> None:
        """Copy for every request whose LB_EVENTS seq is recorded (``final``: every one left)."""
        ready = [p for p in self.pending if final or events_recorded_through >= p[0]]
        for item in ready:
            self.pending.remove(item)
            _, target, future = item
            try:
                await self._run_db(copy_database, self._connection(), target, self._memory_limit_mb())
                future.set_result({"path": str(target)})
                log.info("copied the log to %s for a reader", target)
            except Exception as exc:  # noqa: BLE001 - reported to the reader, never fatal here
                future.set_result({"error": f"copy failed: {exc}"})
        if not self.pending:
            self.gate.set()

    def close(self) -> None:
        """The recorder stops: every request still waiting is answered with an error."""
        for _, _, future in self.pending:
            if not future.done():
                future.set_result({"error": "recorder stopping"})


COPY_MEMORY_MB = 64  # DuckDB's limit while it copies (one thread): 32 MB copied an hour's log of 116 MB, 16 failed


def copy_database(con: duckdb.DuckDBPyConnection, target: Path, memory_limit_mb: int = 0) -> None:
    """Copy the whole database into a new file at ``target`` through DuckDB itself.

    Never open the live file a second time from this process (e.g. ``shutil.copyfile``): POSIX
    record locks are per process, and closing any descriptor of the file drops the write lock
    that keeps other processes out. ``memory_limit_mb``: the writer's limit in force (0: none);
    below ``COPY_MEMORY_MB`` the copy runs on one thread under that much, then the limit is
    restored (the copy's memory does not grow with the file).
    """
    literal = str(target).replace("'", "''")
    source = con.execute("SELECT current_database()").fetchone()
    assert source is not None
    tight = 0 < memory_limit_mb < COPY_MEMORY_MB
    row = con.execute("SELECT current_setting('threads')").fetchone() if tight else None
    threads = row[0] if row else 1
    if tight:
        con.execute("SET threads = 1")
        con.execute(f"SET memory_limit = '{COPY_MEMORY_MB}MB'")
    con.execute(f"ATTACH '{literal}' AS laswrr_copy")
    try:
        con.execute(f'COPY FROM DATABASE "{source[0]}" TO laswrr_copy')
    finally:
        con.execute("DETACH laswrr_copy")
        if tight:
            con.execute(f"SET threads = {int(threads)}")
            store.set_memory_limit(con, memory_limit_mb)


# -- the reader's side ----------------------------------------------------------------------------


COPY_ROLES = ("viewer", "operator")  # the roles that may ask for a copy (services/accounts.py)


class CopyForbidden(Exception):
    """The NATS server refused the ``lb.recorder.snapshot`` request to these credentials."""


def copy_from_recorder(nats_url: str, timeout_s: float = 60.0, auth: NatsAuth | None = None) -> store.CopyLocked:
    """``store.open_read``'s ``copy_locked`` for a file that a running recorder holds: ask it,
    over ``lb.recorder.snapshot`` on ``nats_url``, for a consistent copy (blocking). Credentials
    that may not ask (any role but the viewer's or the operator's) fail at once, naming the role
    to use."""

    def copy_locked(db: Path, target: Path) -> None:
        try:
            reply = asyncio.run(_request_copy(nats_url, db, target, timeout_s, auth))
        except CopyForbidden as exc:
            user = urlsplit(nats_url.split(",")[0]).username if "://" in nats_url else None
            who = f"user {user!r}" if user else "these credentials"
            env = db.resolve().parent / "secrets" / "viewer.env"
            where = env if env.exists() else "<data-dir>/secrets/viewer.env"
            raise store.StoreError(
                f"{db} is locked by a running recorder and {who} may not ask the recorder for a copy "
                f"({exc}): use the read-only viewer's credentials (or the operator's): export $(cat {where}) "
                f"(docs/analysts.md)") from None
        except Exception as exc:  # noqa: BLE001 - any NATS failure becomes the one-line explanation
            raise store.StoreError(
                f"{db} is locked by another process and no recorder answered {sj.RECORDER_SNAPSHOT} on "
                f"{redact_url(nats_url)} ({store.first_line(exc) or type(exc).__name__}); "
                f"pass --nats-url of the running stack, or stop the recorder") from None
        if "error" in reply:
            raise store.StoreError(f"{db} is locked by a running recorder, which could not copy it: {reply['error']}")

    return copy_locked


async def _request_copy(nats_url: str, db: Path, target: Path, timeout_s: float,
                        auth: NatsAuth | None = None) -> dict[str, str]:
    denied: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on_error(exc: Exception) -> None:  # nats-py reports a refused publish only here
        text = str(exc)
        if "permissions violation" in text.lower() and not denied.done():
            denied.set_result(text.removeprefix("nats: "))

    nc = await asyncio.wait_for(connect(nats_url, "laswrr-reader", auth, connect_timeout=2, max_reconnect_attempts=0,
                                        allow_reconnect=False, error_cb=on_error), 3.0)
    try:
        body = json.dumps({"db": str(db.resolve()), "to": str(target)}).encode()
        request = asyncio.ensure_future(nc.request(sj.RECORDER_SNAPSHOT, body, timeout=timeout_s))
        await asyncio.wait({request, denied}, return_when=asyncio.FIRST_COMPLETED)
        if denied.done():
            request.cancel()
            with contextlib.suppress(BaseException):
                await request
            raise CopyForbidden(denied.result())
        msg = request.result()
        return dict(json.loads(msg.data))
    finally:
        await nc.close()
