"""Flow control in the log: lb.req.queued then lb.req.started or lb.req.refused with the same id,
batched as a proxy sends them; the `queued` view, `laswrr report`'s queue section, exact replay."""

from __future__ import annotations

from pathlib import Path

from laswrr.replay import store
from laswrr.replay.replay import replay_db
from laswrr.replay.report import gather
from laswrr.replay.synthetic import LogBuilder
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import batch_item, batch_payload

T = 1_700_000_000_000_000_000
MS = 1_000_000


def _queued(rid: str, band: str, key: str | None, at_ms: int) -> bytes:
    import json
    return batch_item("req.queued", None, json.dumps({
        "request_id": rid, "proxy": "p1", "pool": "default", "band": band, "key_name": key, "work": 500,
        "ttl_ms": 30000, "cause": "saturated", "ts_ns": T + at_ms * MS}).encode())


def test_the_queued_view_and_the_report(tmp_path: Path) -> None:
    import json
    log = LogBuilder()
    log.node("a", 2)
    log.tick()
    items = [
        _queued("p1-b-1", "interactive", "alice", 0),
        _queued("p1-b-2", "batch", "batchjob", 0),
        _queued("p1-b-3", "batch", "batchjob", 10),
        _queued("p1-b-4", "default", None, 10),
        batch_item("req.started", "a", json.dumps({"request_id": "p1-b-1", "proxy": "p1", "ts_ns": T + 40 * MS}).encode()),
        batch_item("req.started", "a", json.dumps({"request_id": "p1-b-2", "proxy": "p1", "ts_ns": T + 900 * MS}).encode()),
        batch_item("req.refused", None, json.dumps({"request_id": "p1-b-3", "proxy": "p1", "status": 429,
                                                    "cause": "queue_timeout", "ts_ns": T + 30_010 * MS}).encode()),
        batch_item("req.refused", None, json.dumps({"request_id": "p1-b-4", "proxy": "p1", "status": 499,
                                                    "cause": "client_disconnected", "ts_ns": T + 510 * MS}).encode()),
    ]
    log.add(sj.req_batch("p1"), batch_payload("b", 1, items))
    log.finished("a", "p1-b-1")
    log.finished("a", "p1-b-2")
    assert all(sj.OUT_REJECTED != s for s in log.outputs.subject)  # the core knows the new kind
    db = tmp_path / "events.duckdb"
    log.write_db(db)
    with store.open_read(db) as con:
        rows = con.execute("SELECT request_id, band, key_name, ended, status, wait_ms FROM queued "
                           "ORDER BY request_id").fetchall()
        report = gather(con)
        replayed = replay_db(con)
    assert rows == [("p1-b-1", "interactive", "alice", "dispatched", None, 40.0),
                    ("p1-b-2", "batch", "batchjob", "dispatched", None, 900.0),
                    ("p1-b-3", "batch", "batchjob", "queue_timeout", 429, 30000.0),
                    ("p1-b-4", "default", None, "client_disconnected", 499, 500.0)]
    queue = report["queue"]
    assert queue["held"] == 4 and queue["ended"] == {"client_disconnected": 1, "dispatched": 2, "queue_timeout": 1}
    batch = next(w for w in queue["waits"] if w["band"] == "batch")
    assert batch["held"] == 2 and batch["expired"] == 1 and batch["wait_ms_p50"] == 15450.0
    assert report["refused"] == 2 and report["zero_interruptions"]
    assert replayed.identical
