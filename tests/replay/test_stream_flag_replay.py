"""``lb.req.finished``'s ``stream`` flag on a log: an event without it (a log written before the
field) decodes and counts as it did (its ``ttft_ms`` as recorded, learned by the latency signal:
the same outputs as the same log with ``stream`` true), a whole answer's (``stream`` false)
teaches nothing, every such log replays exactly, and the views tell the three apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from laswrr.replay import store
from laswrr.replay.replay import replay_db
from laswrr.replay.synthetic import LogBuilder
from laswrr.schemas import subjects as sj

ABSENT = object()


def crafted(stream: object) -> LogBuilder:
    """Two nodes; n1's requests take 3 s to a whole answer or a first token, n2's 50 ms."""
    log = LogBuilder()
    log.node("n1", 8)
    log.node("n2", 8)
    log.tick()
    for i in range(6):
        for node, ttft_ms in (("n1", 3000.0), ("n2", 50.0)):
            rid = f"{node}-{i}"
            log.started(node, rid, snapshot_seq=log.last_snapshot_seq())
            fields = {} if stream is ABSENT else {"stream": stream}
            log.finished(node, rid, ttft_ms=ttft_ms, duration_ms=ttft_ms + 10.0, **fields)
        log.tick()
    return log


def outputs(log: LogBuilder) -> list[tuple[str, bytes]]:
    return [(log.outputs.subject[i], log.outputs.payload(i)) for i in range(len(log.outputs))]


@pytest.fixture(scope="module")
def logs() -> dict[object, LogBuilder]:
    return {stream: crafted(stream) for stream in (ABSENT, True, False)}


def test_an_event_without_the_flag_counts_as_it_did(logs: dict[object, LogBuilder]) -> None:
    old, streamed, whole = logs[ABSENT], logs[True], logs[False]
    assert b'"stream"' not in b"".join(old.inputs.payload(i) for i in range(len(old.inputs)))
    assert outputs(old) == outputs(streamed)  # absent: ttft_ms as recorded, as before the field
    assert outputs(whole) != outputs(old)  # a whole answer's 3 s first byte is no TTFT: n1 is not slower
    assert old.scheduler.state.nodes["n1"].ttft_ewma == 3000.0
    assert whole.scheduler.state.nodes["n1"].ttft_ewma is None


@pytest.mark.parametrize("stream", [ABSENT, True, False], ids=["absent", "true", "false"])
def test_each_form_replays_exactly_and_reads_in_the_views(logs: dict[object, LogBuilder], tmp_path: Path,
                                                          stream: object) -> None:
    path = tmp_path / "events.duckdb"
    logs[stream].write_db(path)
    with store.open_read(path) as con:
        result = replay_db(con)
        rows = con.execute("SELECT DISTINCT stream, ttft_ms, first_byte_ms FROM attempts WHERE node = 'n1'").fetchall()
        rejected = con.execute("SELECT count(*) FROM rejections").fetchone()
    assert result.identical, result.first and result.first.describe()
    assert rejected == (0,)  # every event decoded, the old form too
    expected = {ABSENT: (None, 3000.0, 3000.0), True: (True, 3000.0, 3000.0), False: (False, None, 3000.0)}
    assert rows == [expected[stream]]


def test_the_flag_is_read_from_a_batch_as_alone(tmp_path: Path) -> None:
    """A proxy sends its events in batches: the views read the flag of a batched event the same."""
    log = LogBuilder()
    log.node("n1", 8)
    log.tick()
    log.add(sj.req_batch("p1"), {"events": [
        ["req.started", "n1", {"request_id": "w", "proxy": "p1"}],
        ["req.finished", "n1", {"request_id": "w", "proxy": "p1", "outcome": "completed", "ttft_ms": 900.0,
                                "duration_ms": 900.0, "stream": False}]]})
    path = tmp_path / "events.duckdb"
    log.write_db(path)
    with store.open_read(path) as con:
        assert replay_db(con).identical
        assert con.execute("SELECT stream, ttft_ms FROM requests").fetchall() == [(False, None)]
