"""Reasons are text for people: no view, metric, replay or report reads one (wire contract v1,
docs/wire.md). Two checks: the readers' sources hold no reason-parsing pattern, and a
recorded log whose every reason and error text is reworded gives the same views and report."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import duckdb
import pytest

from laswrr.replay import store
from laswrr.replay.report import gather
from laswrr.replay.synthetic import LogBuilder
from laswrr.scheduler.config import SchedulerConfig
from laswrr.scheduler.core import Scheduler
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope, decode_rejected
from laswrr.schemas.words import RequestOutcome

ROOT = Path(__file__).resolve().parents[2]
# The readers: the views, the report, replay, the scheduler's metrics.
READERS = ["replay/views.sql", "replay/report.py", "replay/replay.py", "replay/portable.py", "replay/whatif.py",
           "services/service_metrics.py", "services/scheduler_service.py"]
# What reading a reason or an error text looks like, in SQL or Python.
PARSING = [
    re.compile(r"\b(reason|error|phase_reason)\b['\"]?\s+(NOT\s+)?(I?LIKE|SIMILAR|~|==?|<>|!=|IN\s*\()", re.I),
    re.compile(r"->>\s*'(reason|error|phase_reason)'\s*(NOT\s+)?(I?LIKE|=|<>|IN\b)", re.I),
    re.compile(r"regexp_\w+\(\s*(\w+\.)?(reason|error|phase_reason)\b", re.I),
    re.compile(r"\b(reason|error)\b\)?\s*(\.(split|startswith|partition|rpartition|find|index)\b|\[)"),
    re.compile(r"\(\s*[\w.()]*\.(reason|error)\s*\)"),  # a function of a reason (a label cut from it)
    re.compile(r"re\.(compile|search|match|findall|sub)\(.*(reason|retried|unpublishable|deadline)", re.I),
    re.compile(r"'(retried: |drain deadline|unpublishable output)", re.I),
]
# The interruptions view's column ``reason`` is the view's own code (not text): comparing it is fine.
VIEW_CODES = re.compile(r"reason = '(router_aborted|engine_cut|proxy_gone|open_at_proxy_stop|open_at_end)'")


@pytest.mark.parametrize("path", READERS)
def test_no_reader_parses_a_reason(path: str) -> None:
    text = (ROOT / path).read_text(encoding="utf-8")
    found = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)
             if not line.lstrip().startswith(("--", "#")) and any(p.search(VIEW_CODES.sub("", line)) for p in PARSING)]
    assert not found, f"{path} reads reason text: {found}"


def test_the_scan_finds_what_the_views_did_before_v1() -> None:
    """The patterns above catch the reason parsing the views, metrics and codec had."""
    before = ["WHEN d.reason LIKE 'drain deadline%' THEN 'deadline' ELSE 'inflight' END AS drained_by,",
              "FROM numbered WHERE outcome = 'continued' OR next_attempt IS NOT NULL OR error LIKE 'retried: %'",
              "self.stats.rejections[reason_class(_REJECTED.decode(output.data).reason)] += 1",
              "head = _QUOTED_OR_NUMBER.sub(\"\", reason.split(\":\", 1)[0])",
              "_UNPUBLISHABLE_LIMIT = re.compile(rb'\"reason\":\"unpublishable output: .* over the limit of (\\d+) bytes')"]
    assert all(any(p.search(line) for p in PARSING) for line in before)


# -- behaviour: reword every reason, the answers stay ------------------------------------------------


def _log() -> LogBuilder:
    """A deadline drain (a), a drain to in-flight 0 (b), a retry and a continuation with typed
    next_attempt and status, a rejected input and an ejection by failed probes (c)."""
    log = LogBuilder(SchedulerConfig(drain_deadline_ms=300, health_fail_threshold=2))
    for node in ("a", "b", "c", "d"):
        log.node(node, 4)
    log.tick()
    log.started("a", "q1")
    log.started("b", "q2")
    log.add(sj.admin_drain("a"))
    log.add(sj.admin_drain("b"))
    log.finished("b", "q2", status=200)
    for _ in range(5):
        log.tick()  # a's drain deadline passes with q1 in flight
    log.started("c", "q3")
    log.finished("c", "q3", outcome=RequestOutcome.UPSTREAM_ERROR, ttft_ms=None, status=502,
                 error="retried: HTTP 502", next_attempt="q3.1")
    log.started("d", "q3.1")
    log.finished("d", "q3.1", status=200)
    log.started("c", "q4")
    log.finished("c", "q4", outcome=RequestOutcome.CONTINUED, status=200, completion_tokens=3,
                 error="stalled", next_attempt="q4.1")
    log.started("d", "q4.1")
    log.finished("d", "q4.1", status=200, completion_tokens=4)
    log.add(sj.admin_capacity("nope"), {"capacity": 1})
    log.add(sj.health("c"), {"ok": False, "error": "connection refused"})
    log.add(sj.health("c"), {"ok": False, "error": "connection refused"})
    log.tick()
    return log


REWORD = [  # every text for people in the log, replaced by one word
    ("LB_OUT", r'"(reason|phase_reason)":"(\\.|[^"\\])*"', '"\\1":"reworded"'),
    ("LB_EVENTS", r'"error":"(\\.|[^"\\])*"', '"error":"reworded"'),
]
TEXT_COLUMNS = {"reason", "started_reason", "drained_reason", "phase_reason", "error"}


def _answers(path: Path) -> dict[str, Any]:
    with store.open_read(path) as con:
        views: dict[str, Any] = {}
        for view in ("drains", "continuations", "requests", "attempts", "interruptions", "phase_changes"):
            cursor = con.execute(f"SELECT * FROM {view}")
            names = [d[0] for d in cursor.description]
            views[view] = sorted(
                (tuple((n, v) for n, v in zip(names, row) if n not in TEXT_COLUMNS) for row in cursor.fetchall()),
                key=repr)
        report = gather(con)
    report["drains"] = [{k: v for k, v in d.items() if k != "reason"} for d in report["drains"]]
    return {"views": views, "report": report}


def test_reworded_reasons_give_the_same_views_and_report(tmp_path: Path) -> None:
    path = tmp_path / "log.duckdb"
    _log().write_db(path)
    before = _answers(path)
    drains = {d["node"]: d["by"] for d in before["report"]["drains"]}
    assert drains == {"a": "deadline", "b": "inflight"}  # the log holds what the check is about
    assert before["report"]["retried_before_first_byte"] == 1 and before["report"]["continuations"] == 1
    assert before["report"]["status_classes"]["engine"].get("2xx") == 3
    con = duckdb.connect(str(path))
    for stream, pattern, replacement in REWORD:
        con.execute("UPDATE events SET data = regexp_replace(data, ?, ?, 'g') WHERE stream = ?",
                    [pattern, replacement, stream])
    reworded = con.execute("SELECT count(*) FROM events WHERE data LIKE '%\"reworded\"%'").fetchone()
    con.close()
    assert reworded is not None and reworded[0] > 10
    assert _answers(path) == before


def test_every_rejection_output_carries_the_cause_the_metric_counts() -> None:
    """The scheduler service counts ``Output.cause`` (no decode): it is the payload's cause."""
    core = Scheduler()
    bad = [(sj.admin_capacity("nope"), b'{"capacity": 1}'), (sj.admin_capacity("x"), b"not json"),
           ("lb.nowhere.x", b"{}"), (sj.ADMIN_CONFIG, b'{"set": {"nope": 1}}'),
           (sj.req_batch("p1"), b'{"events": [["req.finished", "n1", {"request_id": "r", "proxy": "p1", '
                                b'"outcome": "completed"}]]}')]
    for seq, (subject, data) in enumerate(bad, 1):
        [output] = core.apply(Envelope(seq, seq, subject, data))
        assert output.subject == sj.OUT_REJECTED and output.cause == decode_rejected(output.data).cause


# -- the proxy: a failure's kind is typed (schemas.words.FailureKind), never read from its text ------------

PROXY = ["services/proxy", "scheduler/routing"]
READ_TEXT = re.compile(r"\b(reason|error)\)?\.(startswith|endswith|split|partition|rpartition|find|"
                       r"index|removeprefix)\(|startswith\(\s*RETRIED_PREFIX")


def test_the_proxy_reads_no_failure_text() -> None:
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for folder in PROXY
             for path in sorted((ROOT / folder).glob("*.py"))
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if READ_TEXT.search(line)]
    assert not found, "classify by FailureKind, not by reason text:\n" + "\n".join(found)
    assert READ_TEXT.search('        if self.reason.startswith("timeout"):')  # what the forwarder did before
