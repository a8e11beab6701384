"""The recorded log in DuckDB: one table, the analyst views, and the one-writer rule.

Table (docs/wire.md): ``events(stream, seq, ts_ns, subject, data, raw)``, one row per
``(stream, seq)``. The payload is kept byte for byte: ``data`` is its text when it is UTF-8
(malformed JSON, NUL bytes and all, exactly as it came) and ``raw`` is NULL; a payload that is not
UTF-8 (DuckDB's VARCHAR cannot hold it) has its exact bytes in the BLOB ``raw`` and, in ``data``,
its text with U+FFFD for the bad bytes, for reading only. The exact payload is therefore
``coalesce(raw, encode(data))`` (``PAYLOAD_SQL``), which is what replay feeds the core. A file
written before ``raw`` existed gets the column (all NULL: its text was all there was) when a
recorder opens it; a reader of such a file (read-only), or of an old Parquet export, sees
``events`` through a view that adds it, so every reader and view can rely on it.
``insert_rows`` passes each column as one list parameter (``unnest``), which is much faster than
``executemany`` (docs/evidence/code-choices.md) and needs neither pyarrow nor pandas. It inserts
what it is given: a row already in the file is the writer's to leave out (the recorder drops
every seq it has recorded, services/recorder.py). The table has no primary key: DuckDB keeps a
key's index (an ART) in memory beyond its ``memory_limit``, about 180 bytes a row, so a
recorder's memory grew with the log for as long as it ran (docs/evidence/soak.md). A file made
with the key (``(stream, seq)``, before 2026-12) keeps it and works as before; ``has_key`` says
which a file is.

One writer per DuckDB file (docs/design.md, "Hazards designed for"). While the recorder runs it holds the file's write lock
and no other process can open it, not even read-only. ``open_read`` therefore:

1. opens the file read-only when nobody holds it (the stack is stopped);
2. otherwise calls ``copy_locked(db, target)``, given by the caller, to have a consistent copy
   written into a private temporary directory, and opens that copy. The ``laswrr`` commands
   pass ``services.recorder_copy.copy_from_recorder``, which asks the running recorder over the
   NATS request ``lb.recorder.snapshot`` (between two batches, after recording LB_EVENTS up to
   the stream's end, the recorder copies the database with DuckDB's ``COPY FROM DATABASE``);
   this module itself does no IO beyond DuckDB files;
3. fails with one clear line when neither works.

A Parquet export (``laswrr export``) is opened in memory with ``events`` as a view over it, so
every reader also works on long-retention exports.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import duckdb

from laswrr.schemas import facts

EVENTS_DDL = """
CREATE TABLE IF NOT EXISTS events (
    stream  VARCHAR NOT NULL,
    seq     BIGINT  NOT NULL,
    ts_ns   BIGINT  NOT NULL,
    subject VARCHAR NOT NULL,
    data    VARCHAR NOT NULL,
    raw     BLOB
)
"""
PAYLOAD_SQL = "coalesce(raw, encode(data))"
"""The exact payload bytes of an ``events`` row."""

_INSERT = """
INSERT INTO events
SELECT * FROM (SELECT unnest($stream::VARCHAR[]) AS stream, unnest($seq::BIGINT[]) AS seq,
                      unnest($ts::BIGINT[]) AS ts_ns, unnest($subject::VARCHAR[]) AS subject,
                      unnest($data::VARCHAR[]) AS data, unnest($raw::BLOB[]) AS raw)
"""

DB_FILE = "events.duckdb"


class StoreError(RuntimeError):
    """The log cannot be opened or read; the message is meant for a one-line CLI error."""


@dataclass
class Columns:
    """A batch of rows of one stream, column by column (what ``insert_rows`` takes)."""

    stream: str
    seq: list[int] = field(default_factory=list)
    ts_ns: list[int] = field(default_factory=list)
    subject: list[str] = field(default_factory=list)
    data: list[str] = field(default_factory=list)
    raw: list[bytes | None] = field(default_factory=list)

    def append(self, seq: int, ts_ns: int, subject: str, payload: bytes) -> None:
        """One message; ``payload`` is the exact bytes received (split as the module header says)."""
        text, raw = split_payload(payload)
        self.seq.append(seq)
        self.ts_ns.append(ts_ns)
        self.subject.append(subject)
        self.data.append(text)
        self.raw.append(raw)

    def payload(self, index: int) -> bytes:
        raw = self.raw[index]
        return raw if raw is not None else self.data[index].encode()

    def __len__(self) -> int:
        return len(self.seq)


def split_payload(payload: bytes) -> tuple[str, bytes | None]:
    """``(data, raw)`` for one payload: its text and no raw bytes when it is UTF-8, else the text
    with U+FFFD replacements (for reading only) and the exact bytes."""
    try:
        return payload.decode("utf-8"), None
    except UnicodeDecodeError:
        return payload.decode("utf-8", "replace"), bytes(payload)


def views_sql() -> str:
    """The ``fact_kinds`` view (from the fact table), then the analyst views of views.sql."""
    return fact_kinds_sql() + resources.files("laswrr.replay").joinpath("views.sql").read_text(encoding="utf-8")


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def fact_kinds_sql() -> str:
    """``fact_kinds(kind, struct, family, key, batchable, output)``: the fact table (schemas.facts)
    as a view, one row per kind, ``family`` its subject (or prefix, ``key`` then saying what the
    last token names: ``node``, ``proxy`` or ``pool``; ``none`` for a whole subject)."""
    rows = ",\n    ".join(
        f"({_quote(f.kind)}, {_quote(f.struct.__name__)}, {_quote(f.subject)}, {_quote(f.key.word)}, "
        f"{str(f.batchable).lower()}, {str(f in facts.OUTPUTS).lower()})" for f in facts.FACTS)
    return ("-- The fact table (schemas/facts.py), written by replay/store.py before the views below.\n"
            "CREATE OR REPLACE VIEW fact_kinds AS\n"
            f"SELECT * FROM (VALUES\n    {rows}\n) AS t(kind, struct, family, key, batchable, output);\n\n")


def core_outputs_filter() -> str:
    """A SQL condition on ``subject`` true for every output subject of the core (schemas.facts.OUTPUTS)."""
    terms = [f"subject = {_quote(f.subject)}" if f.key is facts.Key.NONE else f"subject LIKE {_quote(f.subject + '.%')}"
             for f in facts.OUTPUTS]
    return f"({' OR '.join(terms)})"


def create_schema(con: duckdb.DuckDBPyConnection) -> None:
    """The events table (if missing) and every analyst view (replaced: views.sql is the truth)."""
    con.execute(EVENTS_DDL)
    create_views(con)


def create_views(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(views_sql())


def open_writer(path: str | os.PathLike[str], memory_limit_mb: int | None = None) -> duckdb.DuckDBPyConnection:
    """Open (or create) the log for writing; the caller is the file's one writer.

    ``memory_limit_mb`` caps DuckDB's memory on this connection (``set_memory_limit``). Without it
    DuckDB keeps every block it wrote or read in its buffer cache up to 80 % of RAM, so a writer's
    RSS may grow with the file; with it, DuckDB evicts cached blocks past the cap (they are re-read
    from the file when needed)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        con = duckdb.connect(str(path))
    except duckdb.IOException as exc:
        raise StoreError(f"cannot open {path} for writing: {first_line(exc)}") from None
    if memory_limit_mb is not None:
        set_memory_limit(con, memory_limit_mb)
    create_schema(con)
    return con


def set_memory_limit(con: duckdb.DuckDBPyConnection, mb: int) -> None:
    """DuckDB's ``memory_limit`` of ``mb``, and a checkpoint once the WAL holds a quarter of it:
    what DuckDB cannot evict is the data written since its last checkpoint, so its default
    threshold (16 MB) would let that alone fill a small limit (docs/evidence/soak.md)."""
    con.execute(f"SET memory_limit = '{int(mb)}MB'")
    con.execute(f"SET checkpoint_threshold = '{max(1, int(mb) // 4)}MB'")


def out_of_memory(exc: BaseException) -> bool:
    """DuckDB refused for want of memory under its ``memory_limit``: raised as such, or as the
    commit's or the checkpoint's failure it caused ("failed to pin block ... Increasing the memory
    limit": DuckDB says so only in the message; a full disk's says "No space left on device")."""
    return isinstance(exc, duckdb.OutOfMemoryException) or "memory" in str(exc).lower()


def has_rows(con: duckdb.DuckDBPyConnection, stream: str, seqs: Sequence[int]) -> bool:
    """Every one of ``seqs`` of ``stream`` is in the file (one transaction's rows: all or none)."""
    if not seqs:
        return True
    row = con.execute("SELECT count(DISTINCT seq) FROM events WHERE stream = ? AND seq >= ? AND seq <= ? "
                      "AND list_contains(?, seq)", [stream, min(seqs), max(seqs), list(seqs)]).fetchone()
    return bool(row) and row[0] == len(set(seqs))


def insert_rows(con: duckdb.DuckDBPyConnection, batches: Sequence[Columns]) -> None:
    """Insert every batch in one transaction, all or nothing; the caller leaves out rows already
    in the file (on a file with the old key one would fail the transaction)."""
    con.execute("BEGIN TRANSACTION")
    try:
        for cols in batches:
            if len(cols):
                con.execute(_INSERT, {"stream": [cols.stream] * len(cols), "seq": cols.seq, "ts": cols.ts_ns,
                                      "subject": cols.subject, "data": cols.data, "raw": cols.raw})
        con.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(duckdb.Error):
            con.execute("ROLLBACK")
        raise


def has_key(con: duckdb.DuckDBPyConnection) -> bool:
    """True for a file made with the old ``PRIMARY KEY (stream, seq)`` (module header)."""
    row = con.execute("SELECT count(*) FROM duckdb_constraints() WHERE table_name = 'events' "
                      "AND constraint_type = 'PRIMARY KEY'").fetchone()
    return bool(row and row[0])


def max_seq(con: duckdb.DuckDBPyConnection, stream: str) -> int:
    row = con.execute("SELECT coalesce(max(seq), 0) FROM events WHERE stream = ?", [stream]).fetchone()
    return int(row[0]) if row else 0


def first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def is_lock_conflict(exc: BaseException) -> bool:
    return isinstance(exc, duckdb.IOException) and "lock" in str(exc).lower()


# -- readers -------------------------------------------------------------------------------------


def parquet_source(path: Path) -> Path | None:
    """``events.parquet`` (or a directory holding it): a Parquet export instead of a DB file."""
    if path.is_dir() and (path / "events.parquet").exists():
        return path / "events.parquet"
    if path.suffix == ".parquet" and path.exists():
        return path
    return None


def open_parquet(source: Path) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(":memory:")
    literal = str(source).replace("'", "''")
    source = f"read_parquet('{literal}')"
    con.execute(f"CREATE VIEW events AS SELECT * FROM {source}")
    create_views(con)
    return con


CopyLocked = Callable[[Path, Path], None]
"""``copy_locked(db, target)``: write a consistent copy of the locked ``db`` at ``target``, or
raise StoreError with the reason."""


@contextlib.contextmanager
def open_read(path: str | os.PathLike[str],
              copy_locked: CopyLocked | None = None) -> Iterator[duckdb.DuckDBPyConnection]:
    """A connection on which ``events`` and the views can be read (see the module header)."""
    db = Path(path)
    parquet = parquet_source(db)
    if parquet is not None:
        con = open_parquet(parquet)
        try:
            yield con
        finally:
            con.close()
        return
    if not db.exists():
        raise StoreError(f"no recorded log at {db}")
    try:
        con = duckdb.connect(str(db), read_only=True)
    except duckdb.Error as exc:
        if not is_lock_conflict(exc):
            raise StoreError(f"cannot open {db}: {first_line(exc)}") from None
        if copy_locked is None:
            raise StoreError(f"{db} is locked by another process ({first_line(exc)})") from None
        with _locked_copy(db, copy_locked) as copy:
            con = _open_copy(copy)
            try:
                yield con
            finally:
                con.close()
        return
    try:
        create_temp_views(con)
        yield con
    finally:
        con.close()


def create_temp_views(con: duckdb.DuckDBPyConnection) -> None:
    """A read-only file may hold views of an older recorder: the current definitions are
    created as temporary views, which take precedence over the file's."""
    con.execute(views_sql().replace("CREATE OR REPLACE VIEW", "CREATE OR REPLACE TEMP VIEW"))


def _open_copy(copy: Path) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(str(copy))  # our private copy: writable, so views can be (re)created
    create_schema(con)
    return con


@contextlib.contextmanager
def _locked_copy(db: Path, copy_locked: CopyLocked) -> Iterator[Path]:
    """A copy made by the file's owner, in a private directory next to the file (the recorder
    writes copies only under its own data directory)."""
    try:
        workdir = Path(tempfile.mkdtemp(prefix=".laswrr-copy-", dir=db.parent))
    except OSError as exc:
        raise StoreError(f"{db} is locked and no copy can be made next to it in {db.parent}: {exc.strerror}") from None
    try:
        target = workdir / DB_FILE
        copy_locked(db, target)
        yield target
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
