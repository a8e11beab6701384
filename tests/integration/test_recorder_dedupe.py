"""The recorder leaves out what the file already holds, without a key on the table: a batch
delivered again, a batch written past a hole it could not fill (NATS gone), and a file made with
the old ``PRIMARY KEY (stream, seq)`` (docs/analysts.md, "A file made with the key"), which the
documented rebuild turns into a file without it. A real nats-server and real DuckDB files."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import duckdb
from nats.aio.msg import Msg

from laswrr.replay import store
from laswrr.schemas import subjects as sj
from laswrr.services.natsbus import connect, ensure_streams
from laswrr.services.recorder import Recorder, RecorderOptions

DOCS = Path(__file__).resolve().parents[2] / "docs" / "analysts.md"
OLD_DDL = store.EVENTS_DDL.replace("raw     BLOB\n", "raw     BLOB,\n    PRIMARY KEY (stream, seq)\n")


async def published(nats_url: str, count: int) -> list[Msg]:
    """``count`` request events on LB_EVENTS, delivered to a pull consumer (real ack subjects)."""
    nc = await connect(nats_url, "test-publisher")
    js = nc.jetstream()
    await ensure_streams(js)
    for i in range(count):
        await js.publish(sj.req_started("n1"), b'{"request_id":"r%d"}' % i)
    sub = await js.pull_subscribe(sj.req_started("n1"), durable="test", stream=sj.EVENTS_STREAM)
    msgs: list[Msg] = []
    while len(msgs) < count:
        msgs += await sub.fetch(count - len(msgs), timeout=5)
    await nc.close()
    return msgs


async def recorder_on(nats_url: str, data_dir: Path) -> Recorder:
    recorder = Recorder(await connect(nats_url, "test-recorder"), RecorderOptions(data_dir=data_dir))
    recorder.con = store.open_writer(recorder.options.db_path)
    return recorder


def seqs(con: duckdb.DuckDBPyConnection) -> list[int]:
    return [r[0] for r in con.execute("SELECT seq FROM events WHERE stream = ? ORDER BY seq",
                                      [sj.EVENTS_STREAM]).fetchall()]


async def test_a_batch_delivered_again_is_recorded_once(nats_url: str, tmp_path: Path) -> None:
    msgs = await published(nats_url, 30)
    recorder = await recorder_on(nats_url, tmp_path)
    assert not store.has_key(recorder.con)  # a new file has no key: the recorder dedupes
    assert await recorder._commit(sj.EVENTS_STREAM, msgs[:20]) is msgs[19]
    assert await recorder._commit(sj.EVENTS_STREAM, msgs[10:25]) is msgs[24]  # 10..19 again
    assert await recorder._commit(sj.EVENTS_STREAM, msgs[:30]) is msgs[29]  # all of it again
    assert seqs(recorder.con) == list(range(1, 31))
    assert recorder.recorded_through[sj.EVENTS_STREAM] == 30 and not recorder.written_above[sj.EVENTS_STREAM]
    assert recorder.stats[sj.EVENTS_STREAM].recorded == 30  # laswrr_recorder_rows_written: rows, not deliveries
    await recorder.nc.close()


async def test_rows_written_past_a_hole_are_not_written_again(nats_url: str, tmp_path: Path) -> None:
    msgs = await published(nats_url, 30)
    recorder = await recorder_on(nats_url, tmp_path)
    assert await recorder._commit(sj.EVENTS_STREAM, msgs[:10]) is msgs[9]
    await recorder.nc.close()  # NATS gone: the hole 11..20 cannot be fetched
    assert await recorder._commit(sj.EVENTS_STREAM, msgs[20:30]) is None  # written, not acked
    assert seqs(recorder.con) == list(range(1, 11)) + list(range(21, 31))
    assert recorder.recorded_through[sj.EVENTS_STREAM] == 10
    assert recorder.written_above[sj.EVENTS_STREAM] == set(range(21, 31))
    recorder.nc = await connect(nats_url, "test-recorder-again")
    recorder.js = recorder.nc.jetstream()
    assert await recorder._commit(sj.EVENTS_STREAM, msgs[25:30]) is msgs[29]  # redelivered; the hole fetched
    assert seqs(recorder.con) == list(range(1, 31))
    assert recorder.recorded_through[sj.EVENTS_STREAM] == 30 and not recorder.written_above[sj.EVENTS_STREAM]
    await recorder.nc.close()


async def test_a_file_made_with_the_key_records_and_the_documented_rebuild_drops_it(
        nats_url: str, tmp_path: Path) -> None:
    db = tmp_path / store.DB_FILE
    with duckdb.connect(str(db)) as con:
        con.execute(OLD_DDL)
    msgs = await published(nats_url, 12)
    recorder = await recorder_on(nats_url, tmp_path)
    assert store.has_key(recorder.con)
    assert await recorder._commit(sj.EVENTS_STREAM, msgs[:8]) is msgs[7]
    assert await recorder._commit(sj.EVENTS_STREAM, msgs) is msgs[11]  # 1..8 again: no conflict raised
    assert seqs(recorder.con) == list(range(1, 13))
    recorder.con.close()
    await recorder.nc.close()

    snippet = re.search(r"### A file made with the key\n.*?```sh\npython - events.duckdb <<'PY'\n(.*?)PY\n```",
                        DOCS.read_text(), re.S)
    assert snippet, "docs/analysts.md lost its rebuild snippet"
    subprocess.run([sys.executable, "-", str(db)], input=snippet.group(1), text=True, check=True, timeout=60)
    con = store.open_writer(db)  # as the next recorder start: the views written again
    assert not store.has_key(con)
    assert seqs(con) == list(range(1, 13))
    assert con.execute("SELECT count(*) FROM input_events").fetchone() == (12,)
    con.close()

