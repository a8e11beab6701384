"""`laswrr report`: the zero-interruption verdict of a recorded run, from the analyst views.

Counts come from the views of ``replay/views.sql`` (``requests`` — client requests, each the
set of its proxy attempts, counted by the outcome of the last attempt — ``interruptions``,
``open_requests``, ``admissions_to_draining``, ``drains``), so what the report says is what an
analyst's SQL says. ``interrupted`` counts the cuts a client saw: ``router_aborted`` outcomes,
streams an engine cut mid-stream that were not continued elsewhere (``engine_cut``; a continued
stream counts by its last attempt, so it is not interrupted), requests still open when their
proxy announced a clean stop, and requests a dead proxy left open in a log that ends after a
clean shutdown. ``continued_streams``, ``continuations`` and ``retried_before_first_byte`` come from the
``continuations`` view, with the median and P99 of the latency a continuation added. Requests open at the end of a log that did not
end cleanly are counted as ``open`` (fate unknown), not as interruptions. The verdict is "zero interruptions" when ``interrupted`` and
``admitted_to_draining`` are both 0.
"""

from __future__ import annotations

from typing import Any

import duckdb

from laswrr.schemas.words import RequestOutcome

OUTCOMES = tuple(outcome.value for outcome in RequestOutcome)  # the report's keys, in this order


def gather(con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    """The report as a plain dict (the ``--json`` object)."""
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
    report["retried_attempts"] = _count(con, "SELECT count(*) FROM attempts WHERE attempt_id <> request_id")
    report["interrupted"] = _count(con, "SELECT count(*) FROM interruptions")
    report["interrupted_open_at_proxy_stop"] = _count(
        con, "SELECT count(*) FROM interruptions WHERE reason = 'open_at_proxy_stop'")
    report["interrupted_engine_cut"] = _count(con, "SELECT count(*) FROM interruptions WHERE reason = 'engine_cut'")
    report.update(continuation_facts(con))
    report["open"] = _count(con, "SELECT count(*) FROM open_requests")
    report["admitted_to_draining"] = _count(con, "SELECT count(*) FROM admissions_to_draining")
    report["drains"] = drains(con)
    report.update(_log_facts(con))
    report["zero_interruptions"] = report["interrupted"] == 0 and report["admitted_to_draining"] == 0
    return report


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
        "SELECT node, pool, started_seq, started_ts_ns, started_reason, drained_ts_ns, duration_ms, drained_by "
        "FROM drains ORDER BY started_seq, node").fetchall()
    keys = ("node", "pool", "started_seq", "started_ts_ns", "reason", "drained_ts_ns", "duration_ms", "by")
    return [dict(zip(keys, row)) for row in rows]


def _log_facts(con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    row = con.execute(
        "SELECT count(*) FILTER (WHERE stream = 'LB_EVENTS'), count(*) FILTER (WHERE stream = 'LB_OUT'), "
        "min(ts_ns) FILTER (WHERE stream = 'LB_EVENTS'), max(ts_ns) FILTER (WHERE stream = 'LB_EVENTS'), "
        "count(*) FILTER (WHERE stream = 'LB_OUT' AND subject = 'lb.out.rejected') FROM events").fetchone()
    assert row is not None
    return {"events": row[0], "outputs": row[1], "first_ts_ns": row[2], "last_ts_ns": row[3], "rejected_inputs": row[4]}


def render(report: dict[str, Any]) -> None:
    """The report as rich tables on stdout."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="requests", show_header=True)
    table.add_column("outcome")
    table.add_column("count", justify="right")
    for key in ("requests", *OUTCOMES, "other_outcome", "open", "interrupted", "admitted_to_draining",
                "continued_streams", "retried_before_first_byte"):
        table.add_row(key, str(report[key]))
    console.print(table)
    verdict = "[green]zero interruptions[/]" if report["zero_interruptions"] else "[red]INTERRUPTIONS FOUND[/]"
    console.print(f"verdict: {verdict} ({report['interrupted']} interrupted, "
                  f"{report['admitted_to_draining']} admitted to draining nodes)")
    console.print(f"log: {report['events']} input events, {report['outputs']} outputs, "
                  f"{report['rejected_inputs']} rejected inputs")
    if report["drains"]:
        drain_table = Table(title="drains", show_header=True)
        for column in ("node", "pool", "started seq", "reason", "duration ms", "by"):
            drain_table.add_column(column)
        for drain in report["drains"]:
            duration = "-" if drain["duration_ms"] is None else f"{drain['duration_ms']:.1f}"
            drain_table.add_row(drain["node"], drain["pool"], str(drain["started_seq"]), drain["reason"] or "",
                                duration, drain["by"] or "not drained")
        console.print(drain_table)
