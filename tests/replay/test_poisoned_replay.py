"""A core exception on one input (a broken invariant, not bad input) in a live run is recorded as
an ``internal error while applying`` rejection; replay from DuckDB (with and without what-if
overrides) and the portable replay reproduce it byte for byte at the same seq instead of
crashing there (all of them apply inputs through ``scheduler.core.apply_guarded``).

The live run is real: nats-server, the scheduler service and the recorder (both in-process),
a DuckDB file under tmp_path. The core is broken by patching one handler so that it changes the
state and then raises for one input; the replay runs with the same patch, as a replay of a log
recorded by that core would.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from live_recording import live_recording

from laswrr.replay import store
from laswrr.replay.portable import LogLine, input_line, replay_lines
from laswrr.replay.replay import replay_db
from laswrr.scheduler.config import SchedulerConfig
from laswrr.scheduler.core import Scheduler
from laswrr.schemas import events as ev
from laswrr.schemas import subjects as sj

BROKEN_CAPACITY = 7
REASON = "internal error while applying: KeyError: 'broken invariant'"


@pytest.fixture
def broken_core(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``lb.admin.capacity`` with capacity 7 half-applies (the capacity is set), then raises."""
    original = Scheduler._on_capacity

    def half_applied_then_raise(self: Scheduler, key: str, event: ev.CapacitySet) -> None:
        original(self, key, event)
        if event.capacity == BROKEN_CAPACITY:
            raise KeyError("broken invariant")

    monkeypatch.setattr(Scheduler, "_on_capacity", half_applied_then_raise)
    yield


async def record_live_run(nats_url: str, data_dir: Path) -> tuple[int, int]:
    """Run scheduler + recorder over a short workload; returns (poisoned seq, last input seq)."""
    async with live_recording(nats_url, data_dir) as live:
        js = live.js
        for node, capacity in (("a", 8), ("b", 4)):
            await js.publish(sj.admin_node(node), b'{"url": "http://%s:8000", "capacity": %d}' % (node.encode(), capacity))
        await js.publish(sj.CLOCK_TICK, b'{"tick": 1}')
        poisoned = (await js.publish(sj.admin_capacity("a"), b'{"capacity": %d}' % BROKEN_CAPACITY)).seq
        await js.publish(sj.CLOCK_TICK, b'{"tick": 2}')
        await js.publish(sj.admin_capacity("b"), b'{"capacity": 2}')
        last = (await js.publish(sj.CLOCK_TICK, b'{"tick": 3}')).seq
        await live.settle(last)
    assert live.service.fold.faults == 1
    return poisoned, last


def portable_inputs(con: Any) -> list[bytes]:
    rows = con.execute(f"SELECT seq, ts_ns, subject, {store.PAYLOAD_SQL} FROM events WHERE stream = 'LB_EVENTS' "
                       "ORDER BY seq")
    return [input_line(*row) for row in rows.fetchall()]


async def test_a_core_exception_in_a_live_run_is_reproduced_by_every_replay(
        nats_url: str, tmp_path: Path, broken_core: None) -> None:
    poisoned, last = await record_live_run(nats_url, tmp_path)
    with store.open_read(tmp_path / store.DB_FILE) as con:
        recorded = con.execute("SELECT subject, data FROM events WHERE stream = 'LB_OUT' ORDER BY seq").fetchall()
        rejections = [msgspec.json.decode(data) for subject, data in recorded if subject == sj.OUT_REJECTED]
        assert rejections == [{"as_of_seq": poisoned, "subject": sj.admin_capacity("a"), "cause": "internal_error",
                               "reason": REASON}]

        exact = replay_db(con)
        assert exact.identical, exact.first and exact.first.describe()
        assert exact.verified_through == last and exact.outputs_compared == len(recorded)

        same_config = {"ease_alpha": SchedulerConfig().ease_alpha}  # the what-if loop, same outputs
        whatif = replay_db(con, overrides=same_config)
        assert whatif.identical and whatif.outputs_compared == len(recorded)

        lines = list(replay_lines(portable_inputs(con)))
    decoder = msgspec.json.Decoder(LogLine)
    portable = [(line.subject, bytes(line.data).decode()) for line in map(decoder.decode, lines)]
    assert portable == recorded  # one replica, in order: LB_OUT order is the core's order
