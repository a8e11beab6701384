"""``laswrr replay --db PATH --latency`` on a DuckDB log written as the recorder writes it
(replay/latency.py): a proxy's request events, some in ``lb.req.batch.<proxy>`` messages and some
alone, refold to what the in-memory fold finds; an altered event makes the command exit 1 and
name the mismatch; an undecodable one is counted, not fatal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec

from laswrr.replay import store
from laswrr.replay.latency import refold, report_lines
from laswrr.schemas import events as ev
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import batch_item, batch_payload, event_type
from tests.scheduler.test_latency_fold import BOOT, PROXY, fold_of, run_proxy



def write_log(path: Path, log: list[tuple[str, bytes]]) -> None:
    """The events as the recorder stores them: runs of 5 in one batch message, every 7th alone."""
    rows = store.Columns(sj.EVENTS_STREAM)
    items: list[bytes] = []

    def flush() -> None:
        if items:
            rows.append(len(rows) + 1, len(rows), f"{sj.REQ_BATCH}.{PROXY}", batch_payload(BOOT, len(rows), items))
            items.clear()

    for index, (subject, data) in enumerate(log):
        cls, key = event_type(subject)
        if index % 7 == 0:
            flush()
            rows.append(len(rows) + 1, len(rows), subject, data)
            continue
        items.append(batch_item(cls.KIND, None if cls is ev.RequestRefused else key, data))
        if len(items) == 5:
            flush()
    flush()
    rows.append(len(rows) + 1, len(rows), f"{sj.REQ_STARTED}.n1", b"{not json")
    con = store.open_writer(path)
    store.create_schema(con)
    store.insert_rows(con, [rows])
    con.close()


def run_command(db: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "LASWRR_"))}
    env["NATS_URL"] = "nats://127.0.0.1:1"
    return subprocess.run([sys.executable, "-m", "laswrr", "replay", "--db", str(db), "--latency"],
                          capture_output=True, text=True, timeout=120, env=env)


def test_the_log_refolds_as_the_events_do_and_an_altered_one_is_named(tmp_path: Path) -> None:
    proxy = run_proxy(seed=3, requests=150)
    db = tmp_path / "events.duckdb"
    write_log(db, proxy.log)
    expected = fold_of(proxy.decoded())
    with store.open_read(db) as con:
        fold, bad = refold(con)
    assert bad == 1 and fold.mismatches == 0 and fold.checked == expected.checked and fold.checked["refusal"] > 0
    assert fold.accuracy() == expected.accuracy()
    lines = report_lines(fold, bad)
    assert "every one reproduced" in lines[1] and any(line.startswith("  all ") for line in lines), lines
    done = run_command(db)
    assert done.returncode == 0 and "every one reproduced" in done.stdout, done.stdout + done.stderr

    altered = list(proxy.log)
    index = next(i for i, (s, _) in enumerate(altered) if s.startswith(sj.REQ_FINISHED) and i > 20)
    subject, data = altered[index]
    finished = msgspec.json.decode(data, type=ev.RequestFinished)
    assert finished.ttft_ms is not None
    altered[index] = (subject, msgspec.json.encode(msgspec.structs.replace(finished, ttft_ms=finished.ttft_ms * 2)))
    bad_db = tmp_path / "altered.duckdb"
    write_log(bad_db, altered)
    done = run_command(bad_db)
    assert done.returncode == 1 and "MISMATCH" in done.stdout and "recorded {'predicted_ttft_ms'" in done.stdout, \
        done.stdout + done.stderr
