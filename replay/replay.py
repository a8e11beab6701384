"""Exact replay of a recorded log: feed LB_EVENTS rows through the core, diff against LB_OUT.

Theory of operation. The scheduler's outputs are a pure function of its inputs (docs/algorithm.md §6), so
the recorded inputs (their exact payload bytes, ``store.PAYLOAD_SQL``), applied in stream-sequence order to a fresh ``Scheduler`` that starts from
``SchedulerConfig()`` defaults (recorded ``lb.admin.config`` events then set the configuration
that was in force), must reproduce every recorded output byte for byte. Inputs go through
the fold (``scheduler.fold.Fold``, ``apply_guarded``) as in the service, so an input on which the core raised is reproduced as the
same recorded ``internal error while applying`` rejection.

Outputs are matched by their cause, never by LB_OUT order: two scheduler replicas may
interleave on LB_OUT, so each recorded output is keyed by ``(as_of_seq, subject)`` and compared
with the core's outputs for that input, in core order. The
service publishes with ``Nats-Msg-Id = "<as_of_seq>:<subject>[:<index>]"`` (``Output.msg_id``), so
two outputs of one input on one subject (a node that goes draining -> drained at once) are both
kept. A byte-identical republish of one output is counted once. An output the service found
too large to publish was recorded as a rejection with cause ``unpublishable_output`` and the
``limit`` it applied; the replay applies the same replacement (``schemas.codec.publishable``)
with that limit. Logs are read as wire contract v1 (docs/wire.md), the only version there is.

Checks, each naming the input sequence number where it fails:
  * gap      - a sequence number is missing between the first and last recorded input (a
               deleted input is caught even when no output depends on it);
  * order    - event time goes backwards (two inputs swapped; the JetStream timestamp is
               stored with each message and only grows along the stream);
  * output   - a recorded output differs from the core's (an altered input, or a core bug);
  * missing / unexpected - an output on one side only;
  * beyond   - outputs recorded for inputs after the last recorded input (deleted tail).
Inputs after the last one any recorded output names (``max as_of_seq``) are replayed but not
verified: the scheduler had not processed them when recording stopped (the unverified tail).
When the log does not start at sequence 1 (stream retention dropped the head before it was
recorded), the core starts empty at the first recorded input and the summary says which range
was verified: up to the first divergence.

Memory. Neither stream is sorted whole: a month of log holds hundreds of GB of payloads. Each is
read in the file's own order (DuckDB returns a query without ``ORDER BY`` in insertion order),
which is nearly the order replay needs (inputs by seq, recorded outputs by the input they name):
the recorder inserts a batch of rows at once and DuckDB may store a batch's rows in another order
than seq order, but never far from it. A first pass reads only the sequence numbers (and each
output's key) and notes the least one of every run of rows in the file; the second pass reads
the whole rows in the same order, holds them in a buffer, and passes on, sorted, those below the
least one still to come (``_in_order``). Memory is therefore bounded by how far the file's order
strays from seq order (about one recorder batch), not by the length of the log. The gap and
time-order checks run on the inputs as they come out in seq order.
"""

from __future__ import annotations

import contextlib
import heapq
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator
from itertools import islice, starmap
from dataclasses import dataclass, field
from operator import itemgetter, le
from typing import Any

import duckdb

from laswrr.replay.store import PAYLOAD_SQL, StoreError
from laswrr.replay.store import core_outputs_filter
from laswrr.scheduler.fold import Fold
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope, Output, publishable, unpublishable_limit

FETCH_ROWS = 50_000  # inputs (or sequence numbers) per fetch
OUTPUT_ROWS = 2_000  # recorded outputs per fetch: a snapshot of a large pool is several kB
UNREADABLE_SHOWN = 10  # unreadable recorded outputs reported (the lowest LB_OUT seqs)
ORDER_SHOWN = 1000  # inputs flagged by the gap and time-order checks that are reported
CORE_OUT_FILTER = core_outputs_filter()
_KEY = "CASE WHEN raw IS NULL AND json_valid(data) THEN TRY_CAST(data->>'as_of_seq' AS BIGINT) END"
# No ORDER BY: each reads the file's order (the module header: memory).
_INPUTS = f"SELECT seq, ts_ns, subject, {PAYLOAD_SQL} FROM events WHERE stream = 'LB_EVENTS'"
INPUTS_SQL = f"{_INPUTS} ORDER BY seq"  # sorted whole: only for a benchmark of the core alone
INPUT_SEQS_SQL = "SELECT seq FROM events WHERE stream = 'LB_EVENTS'"
_CORE_OUTPUTS = f"SELECT {_KEY} AS key, seq, subject, data FROM events WHERE stream = 'LB_OUT' AND {CORE_OUT_FILTER}"
OUTPUTS_SQL = f"SELECT key, seq, subject, encode(data) FROM ({_CORE_OUTPUTS}) WHERE key IS NOT NULL"
# the same rows when the first pass found every core output naming an input (each is valid JSON
# and raw is NULL): one parse of each payload instead of two (json_valid's)
KEYED_OUTPUTS_SQL = (f"SELECT TRY_CAST(data->>'as_of_seq' AS BIGINT), seq, subject, encode(data) FROM events "
                     f"WHERE stream = 'LB_OUT' AND {CORE_OUT_FILTER}")
OUTPUT_KEYS_SQL = f"SELECT key, seq FROM ({_CORE_OUTPUTS})"
UNKEYED_SQL = ("SELECT seq, subject, data FROM events WHERE stream = 'LB_OUT' "
               "AND seq IN (SELECT unnest($seqs::BIGINT[])) ORDER BY seq")
SUMMARY_SQL = ("SELECT (SELECT count(*) FROM events WHERE stream = 'LB_EVENTS'), "
               "(SELECT min(seq) FROM events WHERE stream = 'LB_EVENTS'), "
               "(SELECT max(seq) FROM events WHERE stream = 'LB_EVENTS'), "
               f"(SELECT count(*) FROM events WHERE stream = 'LB_OUT' AND NOT {CORE_OUT_FILTER})")

OutputHook = Callable[[Envelope, list[Output]], None]


@dataclass(frozen=True)
class Divergence:
    seq: int  # the input sequence number (LB_OUT sequence for an unreadable recorded output)
    kind: str  # gap | order | output | missing | unexpected | beyond | unreadable
    message: str
    expected: str | None = None
    actual: str | None = None

    def describe(self) -> str:
        lines = [f"first divergence at input seq {self.seq} ({self.kind}): {self.message}"]
        if self.expected is not None or self.actual is not None:
            lines.append(f"  expected (recorded): {self.expected if self.expected is not None else '(nothing)'}")
            lines.append(f"  actual   (replayed): {self.actual if self.actual is not None else '(nothing)'}")
        return "\n".join(lines)


@dataclass
class ReplayResult:
    events: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    verified_through: int = 0  # outputs were compared for inputs first_seq..verified_through
    outputs_compared: int = 0
    snapshots: int = 0
    duplicates: int = 0
    foreign_outputs: int = 0  # LB_OUT rows on subjects the core never publishes
    divergences: int = 0
    found: list[Divergence] = field(default_factory=list)  # the first KEEP found (any order)

    @property
    def identical(self) -> bool:
        return self.divergences == 0

    @property
    def retention_gap(self) -> bool:
        return self.first_seq is not None and self.first_seq > 1

    KEEP = 1000

    @property
    def first(self) -> Divergence | None:
        """The divergence at the lowest input seq (checks run in different passes)."""
        return min(self.found, key=lambda d: d.seq) if self.found else None

    @property
    def extra(self) -> list[Divergence]:
        return sorted(self.found, key=lambda d: d.seq)[1:10]

    def add(self, divergence: Divergence) -> None:
        self.divergences += 1
        if len(self.found) < self.KEEP:
            self.found.append(divergence)

    def summary(self) -> str:
        if self.events == 0:
            return "no recorded inputs (LB_EVENTS is empty): nothing to replay"
        span = f"inputs {self.first_seq}..{self.last_seq}"
        lines = [f"replayed {self.events} events ({span}); compared {self.outputs_compared} outputs "
                 f"({self.snapshots} snapshots)"]
        if self.identical:
            lines.append("identical: every recorded output was reproduced byte for byte")
        else:
            lines.append(f"NOT identical: {self.divergences} divergence(s)")
        if self.retention_gap:
            upto = (self.first.seq - 1) if self.first else self.verified_through
            lines.append(f"the log starts at seq {self.first_seq}: inputs 1..{self.first_seq - 1} were dropped by "
                         f"stream retention before recording; the replay started from an empty state, so only "
                         f"{self.first_seq}..{max(upto, self.first_seq - 1)} could be verified")
        if self.last_seq is not None and self.verified_through < self.last_seq:
            lines.append(f"unverified tail: inputs {self.verified_through + 1}..{self.last_seq} have no recorded "
                         f"outputs yet (the scheduler had not processed them when recording stopped)")
        notes = []
        if self.duplicates:
            notes.append(f"{self.duplicates} byte-identical republished output(s) counted once")
        if self.foreign_outputs:
            notes.append(f"{self.foreign_outputs} LB_OUT row(s) on subjects the core does not publish, ignored")
        lines.extend(f"note: {n}" for n in notes)
        return "\n".join(lines)


def fetch_batches(cursor: duckdb.DuckDBPyConnection, size: int = FETCH_ROWS) -> Iterator[list[Any]]:
    while True:
        rows = cursor.fetchmany(size)
        if not rows:
            return
        yield rows


@dataclass
class FileOrder:
    """The first pass over the rows replay reads of one stream (the module header: memory): the
    rows counted before each run of them in the file (``starts``) and the least sort key in the
    run, from which ``_in_order`` knows the least key still to come."""

    starts: list[int] = field(default_factory=list)
    least: list[Any] = field(default_factory=list)
    rows: int = 0

    def add(self, keys: list[Any]) -> None:
        """The sort keys of the next run of rows, in the file's order."""
        if keys:
            self.starts.append(self.rows)
            self.rows += len(keys)
            self.least.append(min(keys))

    def to_come(self) -> list[Any]:
        """Per run, the least key from it to the end of the file."""
        floor = list(self.least)
        for index in range(len(floor) - 2, -1, -1):
            floor[index] = min(floor[index], floor[index + 1])
        return floor


def _in_order(cursor: duckdb.DuckDBPyConnection, order: FileOrder, key: Callable[[Any], Any],
              size: int) -> Iterator[list[Any]]:
    """The rows ``cursor`` returns in the file's order (the rows ``order`` counted, in the same
    order) sorted by ``key``: each batch read joins the rows held, and those below the least key
    still to come go on, sorted. A row that would go on out of order (the file changed between
    the two passes) is a StoreError."""
    to_come, read, last = order.to_come(), 0, None
    held: list[Any] = []
    for batch in fetch_batches(cursor, size):
        read += len(batch)
        held.extend(batch)
        held.sort(key=key)
        if read < order.rows:  # the least key at or after the next row: that of the first pass's run holding it
            cut = bisect_left(held, to_come[bisect_right(order.starts, read) - 1], key=key)
        else:
            cut = len(held)
        if cut:
            ready, held = held[:cut], held[cut:]
            if last is not None and not last < key(ready[0]):
                raise StoreError("the log's rows changed order while replay read them: run the replay again")
            last = key(ready[-1])
            yield ready
    if held or read != order.rows:
        raise StoreError("the log's rows changed while replay read them: run the replay again")


def _input_order(con: duckdb.DuckDBPyConnection) -> FileOrder:
    order = FileOrder()
    for batch in fetch_batches(con.cursor().execute(INPUT_SEQS_SQL)):
        order.add(list(map(_FIRST, batch)))
    return order


@dataclass
class _OutputScan:
    """The first pass over the recorded core outputs' keys."""

    order: FileOrder = field(default_factory=FileOrder)  # of those naming an input
    max_key: int = 0
    unkeyed: list[int] = field(default_factory=list)  # the lowest seqs of those naming none
    unkeyed_rows: int = 0  # how many name none


def _scan_outputs(con: duckdb.DuckDBPyConnection) -> _OutputScan:
    scan = _OutputScan()
    top: int | None = None
    unkeyed: list[int] = []  # the lowest UNREADABLE_SHOWN seqs, negated (a max-heap)
    for batch in fetch_batches(con.cursor().execute(OUTPUT_KEYS_SQL), OUTPUT_ROWS):
        keys = [row for row in batch if row[0] is not None]  # (key, seq): the sort key
        scan.order.add(keys)
        if keys:
            top = max(keys)[0] if top is None else max(top, max(keys)[0])
        if len(keys) == len(batch):
            continue
        scan.unkeyed_rows += len(batch) - len(keys)
        for key, seq in batch:
            if key is not None:
                continue
            if len(unkeyed) < UNREADABLE_SHOWN:
                heapq.heappush(unkeyed, -seq)
            elif -seq > unkeyed[0]:
                heapq.heapreplace(unkeyed, -seq)
    scan.max_key = 0 if top is None else top
    scan.unkeyed = sorted(-seq for seq in unkeyed)
    return scan


_FIRST = itemgetter(0)
_OUTPUT_KEY = itemgetter(0, 1)


class RecordedOutputs:
    """The recorded core outputs in (key, LB_OUT seq) order, consumed one input at a time."""

    def __init__(self, batches: Iterable[list[tuple[int, int, str, bytes]]]) -> None:
        self._rows = (row for batch in batches for row in batch)
        self._next: tuple[int, int, str, bytes] | None = next(self._rows, None)

    @property
    def next_key(self) -> int | None:
        return None if self._next is None else self._next[0]

    def take_below(self, key: int) -> list[tuple[int, int, str, bytes]]:
        """Rows whose key is below ``key`` (outputs of inputs that were not replayed)."""
        taken = []
        while self._next is not None and self._next[0] < key:
            taken.append(self._next)
            self._next = next(self._rows, None)
        return taken

    def take(self, key: int) -> list[tuple[int, int, str, bytes]]:
        taken = []
        while self._next is not None and self._next[0] == key:
            taken.append(self._next)
            self._next = next(self._rows, None)
        return taken


def _text(data: bytes | None) -> str | None:
    return None if data is None else data.decode("utf-8", "replace")


def compare(seq: int, actual: list[Output], recorded: list[tuple[int, int, str, bytes]],
            result: ReplayResult) -> Divergence | None:
    """Diff one input's outputs (core order) with its recorded ones (see the module header)."""
    found: dict[str, list[bytes]] = {}
    for _key, _out_seq, subject, data in recorded:
        same = found.setdefault(subject, [])
        if data in same:
            result.duplicates += 1
        else:
            same.append(data)
    produced: dict[str, list[bytes]] = {}
    for output in actual:
        produced.setdefault(output.subject, []).append(output.data)
    divergence = None
    for subject, datas in produced.items():
        result.outputs_compared += len(datas)
        if subject.startswith(sj.OUT_SNAPSHOT + "."):
            result.snapshots += len(datas)
        expected = found.pop(subject, [])
        divergence = divergence or _diff_subject(seq, subject, expected, datas, result)
    for subject, datas in found.items():
        divergence = divergence or Divergence(seq, "unexpected", f"recorded output on {subject} that the replay "
                                              "did not produce", _text(datas[0]), None)
    return divergence


def _diff_subject(seq: int, subject: str, expected: list[bytes], actual: list[bytes],
                  result: ReplayResult) -> Divergence | None:
    if expected == actual:
        return None
    if not expected:
        return Divergence(seq, "missing", f"the replay produced an output on {subject} that was not recorded",
                          None, _text(actual[0]))
    for index in range(max(len(expected), len(actual))):
        want = expected[index] if index < len(expected) else None
        got = actual[index] if index < len(actual) else None
        if want != got:
            return Divergence(seq, "output", f"output #{index + 1} on {subject} differs", _text(want), _text(got))
    return None


class OrderCheck:
    """Gaps and time going backwards, on the inputs in seq order: an input flags its seq when the
    one before it is not seq - 1 (a gap: the seqs between are ``missing``; of a gap over 10,000
    seqs, the first 10,000), or when its time is before the latest time of the inputs before it
    (an ``order`` divergence). The first ``ORDER_SHOWN`` inputs that flag are reported, into
    ``found`` (replay_db puts them before the replay's own divergences)."""

    def __init__(self) -> None:
        self.found = ReplayResult()
        self.missing: set[int] = set()
        self.flagged = 0
        self._seq: int | None = None
        self._ts = 0

    def inputs(self, batch: list[tuple[int, int, str, bytes]]) -> None:
        """The next inputs, in seq order (a run of seqs whose times do not go back is the usual
        batch: checked without a loop in Python)."""
        first, count = batch[0][0], len(batch)
        if (self._seq is None or (first == self._seq + 1 and batch[0][1] >= self._ts)) and (
                batch[-1][0] - first == count - 1):  # seqs rise, so count of them from first to last: a run
            stamps = list(map(_SECOND, batch))
            if all(map(le, stamps, islice(stamps, 1, None))):
                self._seq, self._ts = batch[-1][0], stamps[-1]
                return
        for seq, ts_ns, _subject, _data in batch:
            prev_seq, prev_ts = self._seq, self._ts
            self._seq, self._ts = seq, ts_ns if prev_seq is None else max(prev_ts, ts_ns)
            if prev_seq is None or (seq == prev_seq + 1 and ts_ns >= prev_ts) or self.flagged >= ORDER_SHOWN:
                continue
            self.flagged += 1
            if seq != prev_seq + 1:
                span = f"{prev_seq + 1}" if seq == prev_seq + 2 else f"{prev_seq + 1}..{seq - 1}"
                self.found.add(Divergence(prev_seq + 1, "gap", f"input seq {span} missing from the log (deleted?)"))
                self.missing.update(range(prev_seq + 1, min(seq, prev_seq + 10_001)))
            if ts_ns < prev_ts:
                self.found.add(Divergence(seq, "order", f"event time goes backwards at seq {seq} ({ts_ns} < {prev_ts} "
                                                        "before it): inputs reordered"))


_SECOND = itemgetter(1)


def replay_db(con: duckdb.DuckDBPyConnection, overrides: dict[str, Any] | None = None,
              on_outputs: OutputHook | None = None, verify: bool = True) -> ReplayResult:
    """Replay every recorded input; compare with the recorded outputs unless ``verify`` is off.

    ``overrides`` (what-if) are applied to the initial configuration and re-applied after every
    recorded ``lb.admin.config`` event, so they stay in force for the whole run.
    """
    result = ReplayResult()
    row = con.execute(SUMMARY_SQL).fetchone()
    assert row is not None
    result.events, result.first_seq, result.last_seq, result.foreign_outputs = row
    if result.events:
        with _reading(con):
            _replay(con, result, overrides, on_outputs, verify)
    return result


def _replay(con: duckdb.DuckDBPyConnection, result: ReplayResult, overrides: dict[str, Any] | None,
            on_outputs: OutputHook | None, verify: bool) -> None:
    check = recorded = None
    max_key = 0
    if verify:
        outputs = _scan_outputs(con)
        max_key = outputs.max_key
        _check_unreadable(con, result, outputs.unkeyed)
        check = OrderCheck()
        sql = OUTPUTS_SQL if outputs.unkeyed_rows else KEYED_OUTPUTS_SQL
        recorded = RecordedOutputs(_in_order(con.cursor().execute(sql), outputs.order, _OUTPUT_KEY, OUTPUT_ROWS))
    inputs = _in_order(con.cursor().execute(_INPUTS), _input_order(con), _FIRST, FETCH_ROWS)
    replayer = _Replayer(Fold(overrides=overrides), result, recorded, max_key,
                         set() if check is None else check.missing, on_outputs)
    replayer.run(inputs, check)
    result.verified_through = min(max_key, result.last_seq or 0) if verify else 0
    if recorded is not None:
        replayer.orphans(recorded.take_below((result.last_seq or 0) + 1))
        _beyond(recorded, result)
    if check is not None:  # the checks' divergences, after the unreadable outputs, before the replay's
        at = min(len(outputs.unkeyed), len(result.found))
        result.found[at:at] = check.found.found
        del result.found[ReplayResult.KEEP:]
        result.divergences += check.found.divergences


READ_MEMORY = 2 << 30
_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000 ** 2, "GB": 1000 ** 3, "TB": 1000 ** 4,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


@contextlib.contextmanager
def _reading(con: duckdb.DuckDBPyConnection) -> Iterator[None]:
    """DuckDB's settings while replay reads, restored after: the file's order for queries without
    ORDER BY (the default); one thread (more threads each hold chunks to hand them on in that
    order); DuckDB's memory at most READ_MEMORY (it keeps every block it reads until its
    memory_limit, 80 % of RAM by default, so on a large file most of the machine; the cap still
    leaves room for a vector of 2,048 snapshots of a large pool). Figures:
    docs/evidence/code-choices.md."""
    names = ("preserve_insertion_order", "threads", "memory_limit")
    saved = {name: str(con.execute(f"SELECT current_setting('{name}')").fetchone()[0])  # type: ignore[index]
             for name in names}
    con.execute("SET preserve_insertion_order = true")
    con.execute("SET threads = 1")
    number, _, unit = saved["memory_limit"].partition(" ")
    with contextlib.suppress(ValueError, KeyError):
        if float(number) * _UNITS[unit.upper()] > READ_MEMORY:
            con.execute(f"SET memory_limit = '{READ_MEMORY}B'")
    try:
        yield
    finally:
        for name, value in saved.items():
            con.execute(f"SET {name} = '{value}'")


class _Replayer:
    """The hot loop (its cost per input: docs/evidence/code-choices.md): per input, build the envelope,
    apply it, and only when the core produced outputs look at the recorded ones.
    Recorded outputs for an input that produced none are found at the next input with outputs
    (or at the end) as orphans."""

    def __init__(self, fold: Fold, result: ReplayResult, recorded: RecordedOutputs | None,
                 max_key: int, missing: set[int], on_outputs: OutputHook | None) -> None:
        self.fold, self.result, self.recorded = fold, result, recorded
        self.max_key, self.missing, self.on_outputs = max_key, missing, on_outputs

    def run(self, inputs: Iterable[list[Any]], check: OrderCheck | None) -> None:
        """Apply every input (the fold re-applies what-if overrides after each recorded config event);
        ``check`` sees each batch before it is applied."""
        apply = self.fold.apply
        for batch in inputs:
            if check is not None:
                check.inputs(batch)
            for envelope in starmap(Envelope, batch):
                outputs = apply(envelope)
                if outputs:
                    self.produced(envelope, outputs)

    def produced(self, envelope: Envelope, outputs: list[Output]) -> None:
        if self.on_outputs is not None:
            self.on_outputs(envelope, outputs)
        recorded, seq = self.recorded, envelope.seq
        if recorded is None or seq > self.max_key:
            return
        next_key = recorded.next_key
        if next_key is not None and next_key < seq:
            self.orphans(recorded.take_below(seq))
        rows = recorded.take(seq)
        for _key, _out_seq, subject, data in rows:
            limit = unpublishable_limit(data) if subject == sj.OUT_REJECTED else None
            if limit is not None:  # the service replaced an output too large to publish: so do we
                outputs = publishable(outputs, envelope.subject, limit)
                break
        _compare_into(seq, outputs, rows, self.result)

    def orphans(self, rows: list[tuple[int, int, str, bytes]]) -> None:
        """Recorded outputs whose input produced nothing in the replay, or is not in the log."""
        result = self.result
        for key, out_seq, subject, data in rows:
            if result.first_seq is not None and key < result.first_seq:
                continue  # caused by an input dropped by retention: outside the verifiable range
            why = "which is not in the log" if key in self.missing else "for which the replay produced nothing"
            result.add(Divergence(key, "unexpected", f"recorded output (LB_OUT seq {out_seq}, {subject}) names input "
                                                     f"seq {key}, {why}", _text(data), None))


def _compare_into(seq: int, outputs: list[Output], recorded: list[tuple[int, int, str, bytes]],
                  result: ReplayResult) -> None:
    divergence = compare(seq, outputs, recorded, result)
    if divergence is not None:
        result.add(divergence)


def _beyond(recorded: RecordedOutputs, result: ReplayResult) -> None:
    rows = recorded.take_below(1 << 62)
    if rows:
        key, out_seq, subject, data = rows[0]
        result.add(Divergence(key, "beyond", f"{len(rows)} recorded output(s) name inputs after the last recorded "
                                             f"input {result.last_seq} (first: LB_OUT seq {out_seq}, {subject}): "
                                             "inputs missing at the end of the log", _text(data), None))


def _check_unreadable(con: duckdb.DuckDBPyConnection, result: ReplayResult, seqs: list[int]) -> None:
    """The recorded core outputs at ``seqs`` (the first pass found no input named in them)."""
    for out_seq, subject, data in con.execute(UNKEYED_SQL, {"seqs": seqs}).fetchall() if seqs else ():
        result.add(Divergence(out_seq, "unreadable", f"recorded output at LB_OUT seq {out_seq} on {subject} is not "
                                                     "valid JSON or names no input", data, None))
