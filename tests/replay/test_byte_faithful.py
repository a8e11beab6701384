"""The log keeps what arrived, byte for byte, and replay feeds exactly those bytes back.

A live run (real nats-server, the scheduler service and the recorder in-process, a DuckDB file)
receives payloads that text cannot carry faithfully: invalid UTF-8 inside a JSON string (the
scheduler rejects it), a NUL byte, a ~1 MB payload and a payload that is not JSON. The DuckDB
rows give back each payload exactly (``store.PAYLOAD_SQL``), ``replay_db`` reproduces every
output with no divergence, the portable form carries them too, and the views treat the non-UTF-8
row as unreadable (``j`` NULL) instead of as the valid message its U+FFFD rendering would be.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
from live_recording import live_recording

from laswrr.replay import store
from laswrr.replay.portable import input_line, read_events
from laswrr.replay.replay import replay_db
from tests.replay_cli import replay_exact
from laswrr.schemas import subjects as sj

BIG = b'{"capacity": 3, "note": "' + b"x" * 1_000_000 + b'"}'
PAYLOADS = [
    (sj.admin_node("c"), b'{"url": "http://c\xff\xfe:8000", "capacity": 2}'),  # invalid UTF-8: rejected live
    (sj.admin_capacity("a"), b'{"capacity": 2, "note": "\xff\xfe"}'),  # in a field the core skips: applied
    (sj.admin_capacity("a"), b'{"capacity": 5, "note": "nul \x00 here"}'),  # a raw NUL byte
    (sj.admin_capacity("b"), BIG),
    (sj.admin_capacity("b"), b"capacity=1 (not json)"),
    (sj.admin_capacity("a"), b'{"capacity": 6}'),
]


async def record(nats_url: str, data_dir: Path) -> dict[int, bytes]:
    published: dict[int, bytes] = {}
    async with live_recording(nats_url, data_dir) as live:
        js = live.js
        for node, capacity in (("a", 8), ("b", 4)):
            body = b'{"url": "http://%s:8000", "capacity": %d}' % (node.encode(), capacity)
            published[(await js.publish(sj.admin_node(node), body)).seq] = body
        for tick, (subject, body) in enumerate(PAYLOADS, start=1):
            published[(await js.publish(subject, body)).seq] = body
            body = b'{"tick": %d}' % tick
            published[(await js.publish(sj.CLOCK_TICK, body)).seq] = body
        await live.settle(max(published), timeout_s=15.0)
    return published


async def test_odd_payloads_are_recorded_exactly_and_replay_exactly(nats_url: str, tmp_path: Path) -> None:
    published = await record(nats_url, tmp_path)
    with store.open_read(tmp_path / store.DB_FILE) as con:
        rows = con.execute(f"SELECT seq, ts_ns, subject, {store.PAYLOAD_SQL} FROM events "
                           "WHERE stream = 'LB_EVENTS' ORDER BY seq").fetchall()
        assert {seq: payload for seq, _, _, payload in rows} == published
        bad_seq = next(seq for seq, body in published.items() if b"c\xff" in body)
        (j, raw), = con.execute("SELECT j, raw FROM input_events WHERE seq = ?", [bad_seq]).fetchall()
        assert j is None and raw == published[bad_seq]  # unreadable, not a valid capacity of 2
        rejected = [msgspec.json.decode(d)["as_of_seq"] for (d,) in con.execute(
            "SELECT data FROM events WHERE subject = 'lb.out.rejected'").fetchall()]
        assert bad_seq in rejected  # the live scheduler rejected the invalid UTF-8

        result = replay_db(con)
        assert result.identical, result.first and result.first.describe()
        assert result.verified_through == max(published) and result.outputs_compared > 0

        lines = [input_line(*row) for row in rows]
    replay_exact(tmp_path / store.DB_FILE)  # `laswrr replay --db`, as an operator runs it
    assert [e.data for e in read_events(lines)] == [payload for *_, payload in rows]  # type: ignore[union-attr]
