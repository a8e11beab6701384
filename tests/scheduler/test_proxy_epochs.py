"""Proxy epochs: a proxy restarted under the same id leaves no phantom in-flight.

Each proxy process stamps a random ``boot_id`` on its events. A new boot id for a proxy id voids
the requests the old process left open, at once (not after ``proxy_timeout_ms`` of silence,
which a restarted proxy's heartbeats would never allow); a late event of the replaced process
voids nothing; a heartbeat's own in-flight count, where lower, voids the oldest open requests.
Events without a boot id (published by hand) name no process and void nothing.
"""

from __future__ import annotations

from laswrr.replay import store
from laswrr.replay.replay import replay_db
from laswrr.replay.synthetic import LogBuilder
from laswrr.schemas import subjects as sj
from tests.scheduler.sched_feed import Feed, rejections, warm_pool


def busy(feed: Feed, n: int, boot: str | None, proxy: str = "p1") -> list[str]:
    return [feed.start("a", proxy=proxy, boot=boot) for _ in range(n)]


def test_a_new_boot_id_voids_what_the_old_process_left_open() -> None:
    feed = warm_pool("a", "b")
    old = busy(feed, 20, "boot-old")
    busy(feed, 3, None, proxy="p2")  # another proxy's requests are not touched
    assert feed.node("a").inflight == 23
    feed.heartbeat("p1", inflight=0, boot="boot-new")  # kill -9, restart with the same --proxy-id
    assert feed.node("a").inflight == 3
    assert feed.view("a")["inflight"] == 3  # the snapshot shows it at once
    assert all(rid not in feed.scheduler.state.open_requests for rid in old)
    # the new process's own requests count, and finish normally
    mine = busy(feed, 2, "boot-new")
    assert feed.node("a").inflight == 5
    assert rejections(feed.finish("a", mine[0], boot="boot-new")) == []
    assert feed.node("a").inflight == 4


def test_a_late_event_of_the_replaced_process_voids_nothing() -> None:
    feed = warm_pool("a")
    old = busy(feed, 2, "A")
    mine = busy(feed, 2, "B")  # B replaces A: A's two are void
    assert feed.node("a").inflight == 2
    assert rejections(feed.finish("a", old[0], boot="A"))  # unknown now: voided
    feed.heartbeat("p1", inflight=5, boot="A")  # a late heartbeat of A: B's requests stay
    assert feed.node("a").inflight == 2 and feed.scheduler.state.proxy_boots["p1"] == "B"
    assert all(rid in feed.scheduler.state.open_requests for rid in mine)


def test_a_heartbeat_count_below_the_schedulers_voids_the_oldest() -> None:
    feed = warm_pool("a")
    ids = busy(feed, 5, "A")
    feed.heartbeat("p1", inflight=5, boot="A")
    assert feed.node("a").inflight == 5
    feed.heartbeat("p1", inflight=2, boot="A")  # three finished events were lost
    assert feed.node("a").inflight == 2
    assert [rid for rid in ids if rid in feed.scheduler.state.open_requests] == ids[3:]
    feed.heartbeat("p1", inflight=9, boot="A")  # higher: a start still on its way; nothing invented
    assert feed.node("a").inflight == 2


def test_heartbeats_without_a_boot_id_are_liveness_only() -> None:
    feed = warm_pool("a")
    busy(feed, 4, None)
    feed.heartbeat("p1", inflight=0)
    assert feed.node("a").inflight == 4


def test_a_drain_ends_when_the_restarted_proxy_shows_up() -> None:
    feed = warm_pool("a", "b")
    busy(feed, 20, "A")
    feed.drain("a")
    feed.tick()
    assert feed.phase("a") == "draining"
    feed.heartbeat("p1", inflight=0, boot="B")
    assert feed.phase("a") == "drained"  # not at the drain deadline


def test_epochs_replay_exactly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    log = LogBuilder()
    log.node("a", 8)
    log.tick()
    for i in range(6):
        log.add(sj.req_started("a"), {"request_id": f"r{i}", "proxy": "p1", "boot_id": "A"})
    log.add(sj.proxy_heartbeat("p1"), {"inflight": 4, "boot_id": "A"})
    log.tick()
    log.add(sj.proxy_heartbeat("p1"), {"inflight": 0, "boot_id": "B"})
    log.add(sj.req_finished("a"), {"request_id": "r5", "proxy": "p1", "outcome": "completed", "boot_id": "A"})
    log.tick()
    path = tmp_path / "epochs.duckdb"
    log.write_db(path)
    with store.open_read(path) as con:
        result = replay_db(con)
    assert result.identical and result.outputs_compared == len(log.outputs)
    assert log.scheduler.state.nodes["a"].inflight == 0
