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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import starmap
from dataclasses import dataclass, field
from typing import Any

import duckdb

from laswrr.replay.store import PAYLOAD_SQL
from laswrr.replay.store import core_outputs_filter
from laswrr.scheduler.fold import Fold
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope, Output, publishable, unpublishable_limit

FETCH_ROWS = 50_000
CORE_OUT_FILTER = core_outputs_filter()
_KEY = "CASE WHEN raw IS NULL AND json_valid(data) THEN TRY_CAST(data->>'as_of_seq' AS BIGINT) END"
INPUTS_SQL = f"SELECT seq, ts_ns, subject, {PAYLOAD_SQL} FROM events WHERE stream = 'LB_EVENTS' ORDER BY seq"
OUTPUTS_SQL = (f"SELECT key, seq, subject, encode(data) FROM (SELECT {_KEY} AS key, seq, subject, data "
               f"FROM events WHERE stream = 'LB_OUT' AND {CORE_OUT_FILTER}) WHERE key IS NOT NULL ORDER BY key, seq")
UNKEYED_SQL = (f"SELECT seq, subject, data FROM events WHERE stream = 'LB_OUT' AND {CORE_OUT_FILTER} "
               f"AND {_KEY} IS NULL ORDER BY seq")
SUMMARY_SQL = (f"SELECT (SELECT count(*) FROM events WHERE stream = 'LB_EVENTS'), "
               f"(SELECT min(seq) FROM events WHERE stream = 'LB_EVENTS'), "
               f"(SELECT max(seq) FROM events WHERE stream = 'LB_EVENTS'), "
               f"(SELECT max({_KEY}) FROM events WHERE stream = 'LB_OUT' AND {CORE_OUT_FILTER}), "
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


class RecordedOutputs:
    """The recorded core outputs in (key, LB_OUT seq) order, consumed one input at a time."""

    def __init__(self, cursor: duckdb.DuckDBPyConnection) -> None:
        self._rows = (row for batch in fetch_batches(cursor) for row in batch)
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


ORDER_SQL = """
SELECT seq, prev_seq, ts_ns, prev_ts FROM (
    SELECT seq, ts_ns, lag(seq) OVER w AS prev_seq,
           max(ts_ns) OVER (w ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_ts
    FROM events WHERE stream = 'LB_EVENTS' WINDOW w AS (ORDER BY seq))
WHERE seq <> prev_seq + 1 OR ts_ns < prev_ts ORDER BY seq LIMIT 1000
"""


def check_order(con: duckdb.DuckDBPyConnection, result: ReplayResult) -> set[int]:
    """Gaps and time going backwards, found in SQL; returns the missing seqs of small gaps."""
    missing: set[int] = set()
    for seq, prev_seq, ts_ns, prev_ts in con.execute(ORDER_SQL).fetchall():
        if prev_seq is not None and seq != prev_seq + 1:
            span = f"{prev_seq + 1}" if seq == prev_seq + 2 else f"{prev_seq + 1}..{seq - 1}"
            result.add(Divergence(prev_seq + 1, "gap", f"input seq {span} missing from the log (deleted?)"))
            missing.update(range(prev_seq + 1, min(seq, prev_seq + 10_001)))
        if prev_ts is not None and ts_ns < prev_ts:
            result.add(Divergence(seq, "order", f"event time goes backwards at seq {seq} ({ts_ns} < {prev_ts} "
                                               "before it): inputs reordered"))
    return missing


def replay_db(con: duckdb.DuckDBPyConnection, overrides: dict[str, Any] | None = None,
              on_outputs: OutputHook | None = None, verify: bool = True) -> ReplayResult:
    """Replay every recorded input; compare with the recorded outputs unless ``verify`` is off.

    ``overrides`` (what-if) are applied to the initial configuration and re-applied after every
    recorded ``lb.admin.config`` event, so they stay in force for the whole run.
    """
    result = ReplayResult()
    row = con.execute(SUMMARY_SQL).fetchone()
    assert row is not None
    result.events, result.first_seq, result.last_seq, max_key, result.foreign_outputs = row
    if not result.events:
        return result
    max_key = max_key or 0
    missing: set[int] = set()
    if verify:
        _check_unreadable(con, result)
        missing = check_order(con, result)
    recorded = RecordedOutputs(con.cursor().execute(OUTPUTS_SQL)) if verify else None
    replayer = _Replayer(Fold(overrides=overrides), result, recorded, max_key, missing, on_outputs)
    replayer.run(con.cursor().execute(INPUTS_SQL))
    result.verified_through = min(max_key, result.last_seq or 0) if verify else 0
    if recorded is not None:
        replayer.orphans(recorded.take_below((result.last_seq or 0) + 1))
        _beyond(recorded, result)
    return result


class _Replayer:
    """The hot loop (its cost per input: docs/evidence/code-choices.md): per input, build the envelope,
    apply it, and only when the core produced outputs look at the recorded ones.
    Recorded outputs for an input that produced none are found at the next input with outputs
    (or at the end) as orphans."""

    def __init__(self, fold: Fold, result: ReplayResult, recorded: RecordedOutputs | None,
                 max_key: int, missing: set[int], on_outputs: OutputHook | None) -> None:
        self.fold, self.result, self.recorded = fold, result, recorded
        self.max_key, self.missing, self.on_outputs = max_key, missing, on_outputs

    def run(self, inputs: duckdb.DuckDBPyConnection) -> None:
        """Apply every input (the fold re-applies what-if overrides after each recorded config event)."""
        apply = self.fold.apply
        for batch in fetch_batches(inputs):
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


def _check_unreadable(con: duckdb.DuckDBPyConnection, result: ReplayResult) -> None:
    for out_seq, subject, data in con.execute(UNKEYED_SQL).fetchmany(10):
        result.add(Divergence(out_seq, "unreadable", f"recorded output at LB_OUT seq {out_seq} on {subject} is not "
                                                     "valid JSON or names no input", data, None))
