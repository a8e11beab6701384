"""`laswrr replay --db PATH --latency`: refold the proxies' latency estimates from a recorded log,
audit every prediction they recorded, and measure the estimate's accuracy.

Reads the request events of LB_EVENTS (``lb.req.batch.<proxy>`` messages unbatched, and the
events published alone) in stream order and feeds them to ``scheduler.routing.latency_fold``
(the pure part: what is refolded, checked and measured is said there). An event that does not
decode is skipped and counted (the core rejected it too).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import duckdb

from laswrr.replay.replay import fetch_batches
from laswrr.replay.store import PAYLOAD_SQL
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import SchemaError, decode_batch, decode_event
from laswrr.schemas.events import Event
from laswrr.scheduler.routing.latency_fold import LatencyFold, learned_from_of

_FAMILIES = (sj.REQ_BATCH, sj.REQ_STARTED, sj.REQ_FINISHED, sj.REQ_REFUSED)
REQUEST_EVENTS_SQL = (f"SELECT seq, subject, {PAYLOAD_SQL} FROM events WHERE stream = '{sj.EVENTS_STREAM}' AND ("
                      + " OR ".join(f"subject LIKE '{family}.%'" for family in _FAMILIES) + ") ORDER BY seq")


# the messages that may name a shared estimate (the text, or bytes that are not UTF-8, kept raw)
NAMING_SQL = REQUEST_EVENTS_SQL.replace(
    " ORDER BY seq", " AND (raw IS NOT NULL OR data LIKE '%\"learned_from\"%') ORDER BY seq")


def request_events(con: duckdb.DuckDBPyConnection, sql: str = REQUEST_EVENTS_SQL
                   ) -> Iterator[tuple[int, str | None, Event | None]]:
    """``(seq, key, event)`` of every request event ``sql`` selects, in stream order (a batch's
    events share its seq); ``event`` None for one that did not decode."""
    for rows in fetch_batches(con.cursor().execute(sql)):
        for seq, subject, payload in rows:
            try:
                if subject.startswith(sj.REQ_BATCH + "."):
                    for item in decode_batch(subject, payload)[1]:
                        yield seq, item.key, item.event
                else:
                    yield (seq, *decode_event(subject, payload))
            except SchemaError:
                yield seq, None, None


def refold(con: duckdb.DuckDBPyConnection, fold: LatencyFold | None = None) -> tuple[LatencyFold, int]:
    """The fold of the log's request events, and how many did not decode. Two passes: the first,
    over the messages whose text names it, finds the shared estimates the picks name
    (``learned_from``), fed from their sequence on."""
    if fold is None:
        sources = {learned_from_of(event) for _, _, event in request_events(con, NAMING_SQL) if event is not None}
        fold = LatencyFold(shared_from=(s for s in sources if s is not None))
    bad = 0
    for seq, key, event in request_events(con):
        if event is None:
            bad += 1
        else:
            fold.apply(key, event, seq)
    return fold, bad


def summary(fold: LatencyFold, bad: int) -> dict[str, Any]:
    """The audit and the accuracy as one JSON-able object (``--json``)."""
    accuracy = fold.accuracy()
    return {
        "proxies": len(fold.models), "shared": len(fold.shared), "picks": fold.picks, "learned": fold.learned,
        "undecodable": bad,
        "checked": dict(fold.checked), "mismatches": fold.mismatches, "unverifiable_refusals": fold.unverifiable,
        "unknown_state": fold.unknown, "unmeasured": fold.unmeasured,
        "first_mismatches": [asdict(m) for m in fold.found[:10]],
        "accuracy": {node or "all": asdict(figures) for node, figures in accuracy.items()},
    }


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def report_lines(fold: LatencyFold, bad: int) -> list[str]:
    """The text report: the audit, then the accuracy table."""
    checked = fold.checked
    shared = f" and {len(fold.shared)} shared by the replicas" if fold.shared else ""
    lines = [f"refolded the latency estimates of {len(fold.models)} proxy process(es){shared}: {fold.picks} picks "
             f"with an estimate, {fold.learned} completed attempts learned from"
             + (f"; {bad} request event(s) did not decode (skipped)" if bad else "")]
    verdict = "every one reproduced" if fold.mismatches == 0 else f"{fold.mismatches} MISMATCH(ES)"
    lines.append(f"audit: {checked['pick']} recorded pick predictions and {checked['refusal']} slo_unmeetable "
                 f"refusals checked: {verdict}")
    if fold.unverifiable:
        lines.append(f"  {fold.unverifiable} slo_unmeetable refusal(s) recorded without their estimate "
                     f"(a proxy older than the audit): not checked")
    lines.extend("  " + mismatch.describe() for mismatch in fold.found[:10])
    lines.append("accuracy: absolute error of the prediction for the node picked, ms, over the completed "
                 "attempts (TTFT from the attempt's start, streamed or not; 'measured': their median TTFT)")
    lines.append(f"  {'node':<24} {'n':>7} {'TTFT P50':>9} {'TTFT P90':>9} {'measured':>9} "
                 f"{'n TPOT':>7} {'TPOT P50':>9} {'TPOT P90':>9}")
    for node, a in fold.accuracy().items():
        lines.append(f"  {node or 'all':<24} {a.attempts:>7} {_cell(a.ttft_p50_ms):>9} {_cell(a.ttft_p90_ms):>9} "
                     f"{_cell(a.measured_ttft_p50_ms):>9} {a.tpot_attempts:>7} {_cell(a.tpot_p50_ms):>9} "
                     f"{_cell(a.tpot_p90_ms):>9}")
    if fold.unmeasured:
        lines.append(f"  ({fold.unmeasured} completed attempt(s) on a node not yet measured at their pick: "
                     f"no prediction)")
    return lines
