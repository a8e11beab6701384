"""``laswrr replay``, ``laswrr report`` and ``laswrr export``: the recorded log, re-run and read.

``replay --events FILE.jsonl`` reads the portable form and prints every output as a JSON line of
the same form (byte-identical for identical input). Malformed lines are reported on stderr with
their line number and become rejections in the output.

``replay --db PATH`` replays the recorded LB_EVENTS rows in sequence order through the core
(starting from the default configuration; recorded ``lb.admin.config`` events set the one in
force) and compares every output with the recorded LB_OUT rows byte for byte: exit 0 and a
summary when all are identical, exit 1 naming the first divergent input seq otherwise.
``--what-if key=value ...`` instead re-runs the inputs with other scheduler parameters (applied
to the initial configuration and re-applied after every recorded config event) and writes
``--out DIR``: whatif.jsonl (counterfactual outputs) and weights.csv (recorded vs what-if
effective weights), then prints how fast each node moved after each capacity or drain event.

``replay --db PATH --latency`` instead refolds the proxies' latency estimates from the recorded
request events (replay/latency.py): every prediction a proxy recorded (its picks' and its
``slo_unmeetable`` answers') is made again and compared, exit 1 naming the mismatches; then the
estimate's accuracy per node, the median and P90 absolute error of the predicted TTFT and TPOT
against the measured ones (``--json``: one JSON object).

``--db`` accepts the recorder's DuckDB file (also while the recorder runs: the file is locked,
so the running recorder is asked over NATS for a consistent copy; see docs/analysts.md) or a
Parquet export directory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from laswrr.replay import store
from laswrr.replay.portable import LineError, replay_lines
from laswrr.scheduler import config as config_mod
from laswrr.schemas.codec import SchemaError
from laswrr.services import settings
from laswrr.services.recorder_copy import copy_from_recorder


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("replay", help="replay a recorded event log through the scheduler core",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--events", metavar="FILE.jsonl",
                        help="portable log: one {seq, ts_ns, subject, data} per line ('-' = stdin)")
    source.add_argument("--db", metavar="PATH", help="recorded log: events.duckdb, or a Parquet export directory")
    parser.add_argument("--config", metavar="FILE.toml", help="initial scheduler configuration for --events")
    parser.add_argument("--what-if", nargs="+", metavar="KEY=VALUE", default=[],
                        help="with --db: re-run with these scheduler parameters (keys of SchedulerConfig)")
    parser.add_argument("--out", metavar="DIR", default="whatif-out", help="what-if output directory (default whatif-out)")
    parser.add_argument("--fraction", type=float, default=0.9,
                        help="what-if summary: time to close this fraction of the gap to the final weight (0.9)")
    parser.add_argument("--latency", action="store_true",
                        help="with --db: refold the proxies' latency estimates, audit their recorded predictions "
                             "and report the estimate's accuracy per node, instead of replaying the core")
    parser.add_argument("--json", action="store_true", help="with --latency: print one JSON object")
    _add_db_options(parser)
    parser.set_defaults(func=run)

    report = subparsers.add_parser("report", help="the zero-interruption verdict of a recorded run",
                                   description="Counts of requests by outcome, interruptions, admissions to "
                                               "draining nodes and drain times, from the analyst views.")
    report.add_argument("--db", metavar="PATH", required=True, help="events.duckdb, or a Parquet export directory")
    report.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    _add_db_options(report)
    report.set_defaults(func=run_report)

    export = subparsers.add_parser("export", help="export the recorded log to Parquet",
                                   description="Write DIR/events.parquet (and one Parquet file per analyst view).")
    export.add_argument("--db", metavar="PATH", required=True, help="events.duckdb")
    export.add_argument("--parquet", metavar="DIR", required=True, help="output directory")
    export.add_argument("--no-views", action="store_true", help="only events.parquet")
    _add_db_options(export)
    export.set_defaults(func=run_export)


    query = subparsers.add_parser("query", help="run SQL on the recorded log and its analyst views",
                                  description="Run one SQL statement on the recorded log (the `events` table and "
                                              "the views of docs/analysts.md) and print the rows as CSV with a "
                                              "header (--json: one JSON object per line). A running recorder's file "
                                              "is read through a consistent copy, as for report; the viewer's "
                                              "credentials suffice.")
    query.add_argument("sql", metavar="SQL", help="e.g. \"SELECT outcome, count(*) FROM requests GROUP BY ALL\"")
    query.add_argument("--db", metavar="PATH", required=True, help="events.duckdb, or a Parquet export directory")
    query.add_argument("--json", action="store_true", help="one JSON object per row")
    _add_db_options(query)
    query.set_defaults(func=run_query)

    history = subparsers.add_parser("history", help="what happened to one node, in order",
                                    description="A node's admin commands (applied or rejected, with the reason), "
                                                "phase changes, capacity, ejections and their causes, and rejected "
                                                "inputs naming it, in log order.")
    history.add_argument("node", metavar="NODE")
    history.add_argument("--db", metavar="PATH", required=True, help="events.duckdb, or a Parquet export directory")
    history.add_argument("--at", metavar="TIME", default=None,
                         help="only around this time: ISO 8601 (2026-12-02T19:30:00Z), HH:MM[:SS] UTC on the log's "
                              "first day, +S seconds after the log's start, or Unix seconds (default: the whole log)")
    history.add_argument("--window-s", type=settings.duration("s"), default=60.0,
                         help="with --at: this long before and after it (default %(default)s)")
    history.add_argument("--json", action="store_true", help="one JSON object per line")
    _add_db_options(history)
    history.set_defaults(func=run_history)


def _add_db_options(parser: argparse.ArgumentParser) -> None:
    settings.add_nats_options(parser)


def _fail(command: str, message: str, code: int = 2) -> int:
    print(f"laswrr {command}: {message}", file=sys.stderr)
    return code


# -- replay ---------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if args.db:
        if args.config:
            return _fail("replay", "--config applies to --events; a recorded log carries its own configuration "
                                   "(use --what-if to change it)")
        if args.latency and args.what_if:
            return _fail("replay", "--latency and --what-if are two different runs: give one")
        return run_latency(args) if args.latency else run_db(args)
    if args.what_if:
        return _fail("replay", "--what-if needs --db")
    if args.latency:
        return _fail("replay", "--latency needs --db")
    if args.json:
        return _fail("replay", "--json applies to --latency")
    if not args.events:
        return _fail("replay", "give --events FILE.jsonl or --db PATH")
    return run_events(args)


def run_events(args: argparse.Namespace) -> int:
    try:
        config = config_mod.load_file(args.config) if args.config else None
    except (OSError, ValueError) as exc:
        return _fail("replay", f"bad --config {args.config}: {exc}")
    try:
        source = sys.stdin.buffer if args.events == "-" else open(args.events, "rb")
    except OSError as exc:
        return _fail("replay", f"cannot read {args.events}: {exc.strerror}")
    errors: list[LineError] = []
    out = sys.stdout.buffer
    with source:
        for line in replay_lines(source, config, errors):
            out.write(line)
    out.flush()
    for error in errors:
        print(f"laswrr replay: {args.events}: {error.reason}", file=sys.stderr)
    return 0


def parse_what_if(items: list[str]) -> dict[str, Any]:
    """``["ease_alpha=0.9", "drain_deadline_ms=5000"]`` -> checked overrides (SchemaError if bad)."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SchemaError(f"--what-if {item!r}: expected KEY=VALUE")
        try:
            overrides[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key.strip()] = raw
    config_mod.with_changes(config_mod.SchedulerConfig(), overrides)
    return overrides


def run_db(args: argparse.Namespace) -> int:
    from laswrr.replay.replay import replay_db

    try:
        overrides = parse_what_if(args.what_if)
    except SchemaError as exc:
        return _fail("replay", str(exc))
    try:
        with store.open_read(args.db, copy_from_recorder(args.nats_url, auth=settings.nats_auth(args))) as con:
            if overrides:
                return _what_if(con, overrides, Path(args.out), args.fraction)
            started = time.perf_counter()
            result = replay_db(con)
            elapsed = time.perf_counter() - started
    except store.StoreError as exc:
        return _fail("replay", str(exc), 1)
    print(result.summary())
    if result.events:
        print(f"{result.events / max(elapsed, 1e-9):,.0f} events/s")
    if result.first is not None:
        print(result.first.describe())
        for more in result.extra:
            print(f"  then: seq {more.seq} ({more.kind}): {more.message}")
        return 1
    return 0


def run_latency(args: argparse.Namespace) -> int:
    from laswrr.replay.latency import refold, report_lines, summary

    try:
        with store.open_read(args.db, copy_from_recorder(args.nats_url, auth=settings.nats_auth(args))) as con:
            fold, bad = refold(con)
    except store.StoreError as exc:
        return _fail("replay", str(exc), 1)
    if args.json:
        print(json.dumps(summary(fold, bad)))
    else:
        print("\n".join(report_lines(fold, bad)))
    return 1 if fold.mismatches else 0


def _what_if(con: Any, overrides: dict[str, Any], out: Path, fraction: float) -> int:
    from laswrr.replay.whatif import run_whatif

    events, outputs, reaches = run_whatif(con, overrides, out, fraction)
    changes = ", ".join(f"{k}={v}" for k, v in overrides.items())
    print(f"what-if ({changes}): replayed {events} events, {outputs} counterfactual outputs")
    print(f"wrote {out / 'whatif.jsonl'} and {out / 'weights.csv'}")
    if reaches:
        print(f"time to {fraction:.0%} of the final weight after each capacity/drain event (ms):")
        print(f"  {'seq':>8} {'node':<12} {'event':<9} {'recorded':>10} {'what-if':>10}   final weight rec -> what-if")
        for r in reaches:
            print(f"  {r.event_seq:>8} {r.node:<12} {r.kind:<9} {_ms(r.recorded_ms):>10} {_ms(r.whatif_ms):>10}   "
                  f"{_w(r.recorded_final)} -> {_w(r.whatif_final)}")
    return 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _w(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


# -- report and export ----------------------------------------------------------------------------


def run_report(args: argparse.Namespace) -> int:
    from laswrr.replay import report

    try:
        with store.open_read(args.db, copy_from_recorder(args.nats_url, auth=settings.nats_auth(args))) as con:
            data = report.gather(con)
    except store.StoreError as exc:
        return _fail("report", str(exc), 1)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        report.render(data)
    return 0


def run_export(args: argparse.Namespace) -> int:
    from laswrr.replay.export import export

    target = Path(args.parquet)
    if target.exists() and not target.is_dir():
        return _fail("export", f"{target} exists and is not a directory")
    try:
        with store.open_read(args.db, copy_from_recorder(args.nats_url, auth=settings.nats_auth(args))) as con:
            written = export(con, target, views=not args.no_views)
    except store.StoreError as exc:
        return _fail("export", str(exc), 1)
    for name, count in written.items():
        print(f"{target / (name + '.parquet')}: {count} rows")
    return 0


def run_query(args: argparse.Namespace) -> int:
    import csv

    import duckdb

    try:
        with store.open_read(args.db, copy_from_recorder(args.nats_url, auth=settings.nats_auth(args))) as con:
            try:
                cursor = con.execute(args.sql)
            except duckdb.Error as exc:
                return _fail("query", store.first_line(exc), 1)
            columns = [d[0] for d in cursor.description or ()]
            rows = cursor.fetchall() if columns else []
    except store.StoreError as exc:
        return _fail("query", str(exc), 1)
    if args.json:
        for row in rows:
            print(json.dumps(dict(zip(columns, row)), default=str))
        return 0
    out = csv.writer(sys.stdout, lineterminator="\n")
    if columns:
        out.writerow(columns)
    out.writerows(rows)
    return 0


# -- history ----------------------------------------------------------------------------------------


def parse_at(text: str, first_ns: int) -> int:
    """``--at`` as Unix nanoseconds (the forms in its help); ValueError for anything else."""
    import datetime

    text = text.strip()
    if text.startswith("+"):
        return first_ns + int(float(text[1:]) * 1e9)
    try:
        return int(float(text) * 1e9)
    except ValueError:
        pass
    if len(text) <= 8 and ":" in text:  # HH:MM[:SS], UTC, on the log's first day
        day = datetime.datetime.fromtimestamp(first_ns / 1e9, datetime.timezone.utc).date()
        clock = datetime.time.fromisoformat(text)
        return int(datetime.datetime.combine(day, clock, datetime.timezone.utc).timestamp() * 1e9)
    moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return int(moment.timestamp() * 1e9)


def run_history(args: argparse.Namespace) -> int:
    import datetime

    try:
        with store.open_read(args.db, copy_from_recorder(args.nats_url, auth=settings.nats_auth(args))) as con:
            first = con.execute("SELECT min(ts_ns) FROM events WHERE stream = 'LB_EVENTS'").fetchone()
            first_ns = int(first[0]) if first and first[0] is not None else 0
            low, high = -1 << 62, 1 << 62
            if args.at is not None:
                try:
                    at = parse_at(args.at, first_ns)
                except ValueError:
                    return _fail("history", f"--at {args.at!r}: give ISO 8601, HH:MM[:SS], +S or Unix seconds")
                low, high = at - int(args.window_s * 1e9), at + int(args.window_s * 1e9)
            rows = con.execute("SELECT ts_ns, seq, kind, detail FROM node_timeline WHERE node = ? AND ts_ns BETWEEN ? "
                               "AND ? ORDER BY seq", [args.node, low, high]).fetchall()
            known = con.execute("SELECT count(*) FROM node_timeline WHERE node = ?", [args.node]).fetchone()
    except store.StoreError as exc:
        return _fail("history", str(exc), 1)
    if not rows:
        where = "" if args.at is None else f" within {args.window_s:g} s of {args.at}"
        extra = "" if known and known[0] else " (the log never names it)"
        print(f"laswrr history: nothing about node {args.node!r}{where}{extra}", file=sys.stderr)
        return 1
    for ts_ns, seq, kind, detail in rows:
        if args.json:
            print(json.dumps({"ts_ns": ts_ns, "seq": seq, "kind": kind, "detail": detail}))
        else:
            when = datetime.datetime.fromtimestamp(ts_ns / 1e9, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
            print(f"{when}  seq {seq:<7} {kind:<16} {detail}")
    return 0
