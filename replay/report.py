"""`laswrr report`: the zero-interruption verdict of a recorded run, from the analyst views.

Counts come from the views of ``replay/views.sql`` (``requests`` — client requests, each the
set of its proxy attempts, counted by the outcome of the last attempt — ``interruptions``,
``open_requests``, ``admissions_to_draining``, ``drains``), so what the report says is what an
analyst's SQL says. ``interrupted`` counts the cuts a client saw: ``router_aborted`` outcomes,
streams an engine cut mid-stream that were not continued elsewhere (``engine_cut``; a continued
stream counts by its last attempt, so it is not interrupted), requests still open when their
proxy announced a clean stop, requests open at a proxy known gone (``proxy_gone``: the
scheduler's recorded ``lb.out.voided`` for a proxy silent for ``proxy_timeout_ms`` or replaced
by a new process of its id), and requests a dead proxy left open in a log that ends after a
clean shutdown. ``continued_streams``, ``continuations`` and ``retried_before_first_byte`` come from the
``continuations`` view (the typed ``next_attempt``), with the median and P99 of the latency a
continuation added. Nothing here compares a reason or an error text: ``status_classes`` and
``error_answers`` read the typed ``status``. Requests still open on a proxy that is alive as far as the log knows are counted as ``open``
(fate unknown), not as interruptions. ``verdict``: ``interruptions_found`` when ``interrupted``
or ``admitted_to_draining`` is not 0, else ``open_requests`` while any request is ``open`` (the
tables say how many; a live stack's log usually has a few in flight), else
``zero_interruptions`` (``zero_interruptions`` is true only then).

``cut_by_router`` is what the router's promise covers and must be 0: ``interrupted`` less the
engine cuts (router_aborted, open at a proxy's stop, open at a proxy gone, left open by a dead proxy).

Error answers are not cuts, and are counted beside the verdict, never hidden by it
(``error_answers`` view): ``answered_with_error`` requests, ``by_engine`` (an engine's 4xx,
a 5xx passed through, or the proxy's 502/504 for an engine that failed before the first byte)
and ``by_router`` (the proxy's own refusals, ``lb.req.refused``), with the most frequent
causes (``top_error_causes``); ``status_classes`` counts the requests by who answered and the
status class of the answer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import duckdb

from laswrr.replay import store
from laswrr.schemas import subjects as sj
from laswrr.schemas.words import RequestOutcome, VoidCause

OUTCOMES = tuple(outcome.value for outcome in RequestOutcome)  # the report's keys, in this order


MATERIALISED = ("input_events", "snapshot_nodes", "attempts", "requests", "interruptions", "refusals", "queued")
"""The views most of the report reads, computed once for it (a view here reads only those before it).
``input_events`` (each batch unnested, each payload parsed: 1.5 CPU s an hour of a busy log, and the
views below read it eight times) and ``snapshot_nodes`` (every kept snapshot parsed) first: the
report of an hour of ``bench/month_log.py`` took 16 CPU s without them, 7 with them
(docs/analysts.md, "A busy month on one file")."""

_STORED = {"input_events": ("seq, ts_ns, subject, family, key, j, CASE WHEN j IS NULL THEN data END AS data, raw, "
                            "event_index, batch_subject",
                            "seq, ts_ns, subject, family, key, j, coalesce(data, j::VARCHAR) AS data, raw, "
                            "event_index, batch_subject")}
"""Views stored in another shape: (the table's columns from the view, the temporary view's from the
table). A parsed payload's text is its JSON's text (a cast to JSON keeps it as it was), so it is
stored once."""


@contextlib.contextmanager
def materialised(con: duckdb.DuckDBPyConnection, views: tuple[str, ...] = MATERIALISED) -> Iterator[None]:
    """While open, each of ``views`` is read from a temporary table holding its rows, computed once
    (the views parse every request event's JSON, and the report reads them some twenty times):
    the same rows, so the same report. A temporary view of the same name shadows the view for
    the connection; on leaving, the tables are dropped and the connection's views are as before."""
    temporary = {name for (name,) in con.execute("SELECT view_name FROM duckdb_views() WHERE temporary").fetchall()}
    try:
        for view in views:
            stored, read = _STORED.get(view, ("*", "*"))
            con.execute(f"CREATE OR REPLACE TEMP TABLE report_{view} AS SELECT {stored} FROM {view}")
            con.execute(f"CREATE OR REPLACE TEMP VIEW {view} AS SELECT {read} FROM report_{view}")
        yield
    finally:
        for view in views:
            con.execute(f"DROP VIEW IF EXISTS temp.{view}")
        if temporary.intersection(views):  # the connection's own temporary views (a read-only file)
            store.create_temp_views(con)
        for view in views:
            con.execute(f"DROP TABLE IF EXISTS temp.report_{view}")


def gather(con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    """The report as a plain dict (the ``--json`` object)."""
    with materialised(con):
        return _gather(con)


def _gather(con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    report: dict[str, Any] = {}
    row = con.execute(
        "SELECT count(*), " + ", ".join(f"count(*) FILTER (WHERE outcome = '{o}')" for o in OUTCOMES)
        + ", count(*) FILTER (WHERE outcome IS NOT NULL AND outcome NOT IN ("
        + ", ".join(f"'{o}'" for o in OUTCOMES) + ")) FROM requests").fetchone()
    assert row is not None
    report["requests"] = row[0]
    report.update(zip(OUTCOMES, row[1:1 + len(OUTCOMES)]))
    report["other_outcome"] = row[-1]
    report["attempts"] = _count(con, "SELECT count(*) FROM attempts")
    # a prefill/decode pair's legs are attempts too: one is a retry only when another names it (next_attempt)
    report["retried_attempts"] = _count(
        con, "SELECT count(*) FROM attempts WHERE attempt_id <> request_id AND (role IS NULL OR attempt_id IN "
             "(SELECT next_attempt FROM attempts WHERE next_attempt IS NOT NULL))")
    report["pd"] = pd_facts(con)
    report["interrupted"] = _count(con, "SELECT count(*) FROM interruptions")
    report["interrupted_open_at_proxy_stop"] = _count(
        con, "SELECT count(*) FROM interruptions WHERE reason = 'open_at_proxy_stop'")
    report["interrupted_engine_cut"] = _count(con, "SELECT count(*) FROM interruptions WHERE reason = 'engine_cut'")
    report["interrupted_proxy_gone"] = _count(con, "SELECT count(*) FROM interruptions WHERE reason = 'proxy_gone'")
    report["cut_by_router"] = report["interrupted"] - report["interrupted_engine_cut"]  # must be 0
    report.update(continuation_facts(con))
    report["open"] = _count(con, "SELECT count(*) FROM open_requests")
    report["finished_event_lost"] = _count(con, f"SELECT count(*) FROM voided_requests WHERE cause = '{VoidCause.FINISH_LOST}'")
    report["admitted_to_draining"] = _count(con, "SELECT count(*) FROM admissions_to_draining")
    report["drains"] = drains(con)
    report.update(_log_facts(con))
    cut = report["interrupted"] > 0 or report["admitted_to_draining"] > 0
    report["verdict"] = "interruptions_found" if cut else "open_requests" if report["open"] else "zero_interruptions"
    report["zero_interruptions"] = report["verdict"] == "zero_interruptions"
    report.update(error_facts(con))
    report["queue"] = queue_facts(con)
    return report


def queue_facts(con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    """Flow control (``queued`` view): requests held, how they left, and the wait P50 / P99 in ms
    per pool, band and key (``-`` for requests without a key)."""
    ended = {str(e): n for e, n in con.execute(
        "SELECT coalesce(ended, 'still_held'), count(*) FROM queued GROUP BY ALL ORDER BY 1").fetchall()}
    waits = [{"pool": pool, "band": band, "key": key, "held": n, "wait_ms_p50": _round(p50), "wait_ms_p99": _round(p99),
              "expired": expired}
             for pool, band, key, n, p50, p99, expired in con.execute(
                 "SELECT pool, band, coalesce(key_name, '-'), count(*), quantile_cont(wait_ms, 0.5), "
                 "quantile_cont(wait_ms, 0.99), count(*) FILTER (WHERE ended = 'queue_timeout') FROM queued "
                 "GROUP BY ALL ORDER BY 1, 2, 3").fetchall()]
    return {"held": sum(ended.values()), "ended": ended, "waits": waits}


TOP_CAUSES = 5


def error_facts(con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    """Requests answered with an error, by whom and why; every request by status class."""
    classes: dict[str, dict[str, int]] = {"engine": {}, "router": {}}
    for by, klass, n in con.execute(
            "SELECT 'engine', status_class, count(*) FROM requests WHERE outcome IS NOT NULL GROUP BY ALL "
            "UNION ALL SELECT 'router', status_class, count(*) FROM refusals GROUP BY ALL ORDER BY 1, 2").fetchall():
        classes[by][klass or "none"] = n
    by_engine = _count(con, "SELECT count(*) FROM error_answers WHERE answered_by = 'engine'")
    by_router = _count(con, "SELECT count(*) FROM error_answers WHERE answered_by = 'router'")
    top = con.execute(
        "SELECT answered_by, status, cause, count(*) AS n FROM error_answers GROUP BY ALL "
        f"ORDER BY n DESC, answered_by, cause LIMIT {TOP_CAUSES}").fetchall()
    return {"refused": _count(con, "SELECT count(*) FROM refusals"), "answered_with_error": by_engine + by_router,
            "answered_with_error_by_engine": by_engine, "answered_with_error_by_router": by_router,
            "status_classes": classes,
            "top_error_causes": [{"by": by, "status": status, "cause": cause, "count": n} for by, status, cause, n in top]}


def pd_facts(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """Prefill/decode pools (``attempts.role``): requests served as pairs and by a decode node
    alone, and the legs of each role with those that did not complete (a failed leg retried, a
    leg cancelled for its partner's failure, a decode leg continued on a new pair)."""
    row = con.execute(
        "SELECT count(DISTINCT request_id) FILTER (WHERE role = 'prefill'), "
        "count(DISTINCT request_id) FILTER (WHERE role = 'decode' AND request_id NOT IN "
        "(SELECT request_id FROM attempts WHERE role = 'prefill')), "
        "count(*) FILTER (WHERE role = 'prefill'), count(*) FILTER (WHERE role = 'prefill' AND outcome <> 'completed'), "
        "count(*) FILTER (WHERE role = 'decode'), count(*) FILTER (WHERE role = 'decode' AND outcome <> 'completed') "
        "FROM attempts").fetchone()
    keys = ("pair_requests", "decode_only_requests", "prefill_legs", "prefill_legs_not_completed", "decode_legs",
            "decode_legs_not_completed")
    return dict(zip(keys, (int(v or 0) for v in row or (0,) * len(keys))))


def continuation_facts(con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    """Streams continued on another node (and their added latency), and attempts retried whole."""
    row = con.execute(
        "SELECT count(DISTINCT request_id) FILTER (WHERE kind = 'continued'), count(*) FILTER (WHERE kind = 'continued'), "
        "count(*) FILTER (WHERE kind = 'retried'), "
        "quantile_cont(added_ms, 0.5) FILTER (WHERE kind = 'continued'), "
        "quantile_cont(added_ms, 0.99) FILTER (WHERE kind = 'continued') FROM continuations").fetchone()
    assert row is not None
    keys = ("continued_streams", "continuations", "retried_before_first_byte", "continuation_added_ms_p50",
            "continuation_added_ms_p99")
    return dict(zip(keys, (row[0], row[1], row[2], _round(row[3]), _round(row[4]))))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _count(con: duckdb.DuckDBPyConnection, sql: str) -> int:
    row = con.execute(sql).fetchone()
    return int(row[0]) if row else 0


def drains(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    rows = con.execute(
        "SELECT node, pool, started_seq, started_ts_ns, started_cause, started_reason, drained_ts_ns, duration_ms, "
        "drained_by, last_attempt_ts_ns, after_last_attempt_ms, later_legs FROM drains ORDER BY started_seq, node"
    ).fetchall()
    keys = ("node", "pool", "started_seq", "started_ts_ns", "cause", "reason", "drained_ts_ns", "duration_ms", "by",
            "last_attempt_ts_ns", "after_last_attempt_ms", "later_legs")
    return [dict(zip(keys, row)) for row in rows]


def _log_facts(con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    row = con.execute(
        "SELECT count(*) FILTER (WHERE stream = 'LB_EVENTS'), count(*) FILTER (WHERE stream = 'LB_OUT'), "
        "min(ts_ns) FILTER (WHERE stream = 'LB_EVENTS'), max(ts_ns) FILTER (WHERE stream = 'LB_EVENTS'), "
        f"count(*) FILTER (WHERE stream = 'LB_OUT' AND subject = '{sj.OUT_REJECTED}') FROM events").fetchone()
    assert row is not None
    return {"events": row[0], "outputs": row[1], "first_ts_ns": row[2], "last_ts_ns": row[3], "rejected_inputs": row[4]}


def render(report: dict[str, Any]) -> None:
    """The report as rich tables on stdout (ids fold onto a second line when the table is too
    wide: never cut, on a terminal or piped)."""
    from rich.console import Console
    from rich.table import Table

    import sys

    console = Console(width=None if sys.stdout.isatty() else 1000)  # piped: as wide as the content, no cut
    table = Table(title="requests", show_header=True)
    table.add_column("outcome")
    table.add_column("count", justify="right")
    for key in ("requests", *OUTCOMES, "other_outcome", "open", "interrupted", "admitted_to_draining",
                "continued_streams", "retried_before_first_byte", "refused"):
        table.add_row(key, str(report[key]))
    console.print(table)
    classes = Table(title="answers by status class", show_header=True)
    for column in ("answered by", "2xx", "3xx", "4xx", "5xx", "none"):
        classes.add_column(column, justify="right" if column != "answered by" else "left")
    for by in ("engine", "router"):
        counts = report["status_classes"][by]
        classes.add_row(by, *(str(counts.get(k, 0)) for k in ("2xx", "3xx", "4xx", "5xx", "none")))
    console.print(classes)
    verdict = {"zero_interruptions": "[green]zero interruptions[/]",
               "interruptions_found": "[red]INTERRUPTIONS FOUND[/]",
               "open_requests": f"[yellow]none found yet, {report['open']} requests still open on live proxies "
                                f"(fate unknown)[/]"}[report["verdict"]]
    gone = f", {report['interrupted_proxy_gone']} with a proxy that died" if report["interrupted_proxy_gone"] else ""
    console.print(f"verdict: {verdict} (cut by the router: {report['cut_by_router']}{gone}; cut by an engine and not "
                  f"continued: {report['interrupted_engine_cut']}; admitted to draining nodes: "
                  f"{report['admitted_to_draining']})")
    pd = report.get("pd") or {}
    if pd.get("pair_requests") or pd.get("decode_only_requests"):
        console.print(f"prefill/decode: {pd['pair_requests']} requests as pairs, {pd['decode_only_requests']} by a "
                      f"decode node alone; prefill legs {pd['prefill_legs']} ({pd['prefill_legs_not_completed']} not "
                      f"completed), decode legs {pd['decode_legs']} ({pd['decode_legs_not_completed']} not completed)")
    errors = report["answered_with_error"]
    tint = "yellow" if errors else "green"
    console.print(f"answered with an error: [{tint}]{errors}[/] (by an engine {report['answered_with_error_by_engine']}, "
                  f"by the router {report['answered_with_error_by_router']})")
    for cause in report["top_error_causes"]:
        console.print(f"  {cause['count']:>8}  {cause['by']:<6} {cause['cause']}")
    queue = report.get("queue") or {}
    if queue.get("held"):
        console.print(f"flow control: {queue['held']} held; left by {queue['ended']}")
        waits = Table(title="queue wait (ms) per pool, band and key", show_header=True)
        for column in ("pool", "band", "key", "held", "P50", "P99", "expired"):
            waits.add_column(column, justify="left" if column in ("pool", "band", "key") else "right", overflow="fold")
        for w in queue["waits"]:
            waits.add_row(w["pool"], w["band"], w["key"], str(w["held"]), str(w["wait_ms_p50"]), str(w["wait_ms_p99"]),
                          str(w["expired"]))
        console.print(waits)
    console.print(f"log: {report['events']} input events, {report['outputs']} outputs, "
                  f"{report['rejected_inputs']} rejected inputs")
    if report["drains"]:
        drain_table = Table(title="drains", show_header=True)
        for column in ("node", "pool", "started seq", "reason", "duration ms", "by", "after last attempt ms"):
            drain_table.add_column(column, overflow="fold")  # an id is never cut, at any width
        for drain in report["drains"]:
            duration = "-" if drain["duration_ms"] is None else f"{drain['duration_ms']:.1f}"
            idle = "-" if drain["after_last_attempt_ms"] is None else f"{drain['after_last_attempt_ms']:.1f}"
            drain_table.add_row(drain["node"], drain["pool"], str(drain["started_seq"]), drain["reason"] or drain["cause"] or "",
                                duration, drain["by"] or "not drained", idle)
        console.print(drain_table)
