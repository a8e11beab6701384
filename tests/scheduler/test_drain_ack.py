"""A drain ends only when every proxy routes on a snapshot from the drain on.

A proxy reports its admissions in batches, so a start it made on a node just before the drain
can reach the scheduler after the drain (CI saw it: vllm-a drained at seq 623 with 0 in flight,
then a start from snapshot 618 came at seq 626, and "drained" showed 1 in flight). A proxy's
heartbeat says which snapshot it routes on (``snapshot_seq``) and follows its earlier events in
one ordered buffer: once each live proxy that says so names a snapshot as of the drain, no such
start is still on its way, and in-flight 0 means drained.
"""

from __future__ import annotations

from laswrr.schemas import subjects as sj
from laswrr.schemas.words import Phase, PhaseCause
from tests.scheduler.sched_feed import Feed, warm_pool


def phase(feed: Feed, node: str) -> Phase:
    return feed.node(node).phase


def test_drained_waits_for_each_proxy_to_route_on_the_drain() -> None:
    feed = warm_pool("a", "b")
    feed.heartbeat("p1", boot="A", snapshot_seq=feed.seq)
    feed.heartbeat("p2", boot="B", snapshot_seq=feed.seq)
    feed.drain("a")
    drain_seq = feed.seq
    assert phase(feed, "a") == Phase.DRAINING  # 0 in flight, but p1 and p2 may have a start in transit
    late = feed.start("a", proxy="p1", boot="A")  # admitted before p1 saw the drain, reported after it
    assert feed.node("a").inflight == 1
    feed.heartbeat("p1", boot="A", inflight=1, snapshot_seq=drain_seq)
    feed.finish("a", late, boot="A")
    assert phase(feed, "a") == Phase.DRAINING  # p2 has not said it saw the drain yet
    feed.heartbeat("p2", boot="B", snapshot_seq=drain_seq - 1)  # an older snapshot: still not
    assert phase(feed, "a") == Phase.DRAINING
    feed.heartbeat("p2", boot="B", snapshot_seq=drain_seq)
    assert phase(feed, "a") == Phase.DRAINED
    assert feed.view("a")["inflight"] == 0


def test_a_proxy_that_says_nothing_of_snapshots_holds_no_drain() -> None:
    feed = warm_pool("a", "b")
    feed.heartbeat("p1", boot="A")  # no snapshot_seq (by hand, or a proxy that does not say)
    feed.drain("a")
    assert phase(feed, "a") == Phase.DRAINED


def test_a_gone_or_replaced_proxy_no_longer_holds_a_drain() -> None:
    feed = warm_pool("a", "b")
    feed.heartbeat("p1", boot="A", snapshot_seq=feed.seq)
    feed.drain("a")
    assert phase(feed, "a") == Phase.DRAINING
    feed.heartbeat("p1", boot="A2")  # p1 restarted: the old process's view is gone with it
    assert phase(feed, "a") == Phase.DRAINED

    feed = warm_pool("a", "b")
    feed.heartbeat("p1", boot="A", snapshot_seq=feed.seq)
    feed.drain("a")
    feed.send(sj.proxy_stopped("p1"), {"boot_id": "A"})
    assert phase(feed, "a") == Phase.DRAINED


def test_the_drain_deadline_still_ends_a_drain_a_proxy_never_acknowledges() -> None:
    feed = warm_pool("a", "b")
    feed.heartbeat("p1", boot="A", snapshot_seq=1)
    feed.drain("a")
    for _ in range(int(feed.scheduler.config.drain_deadline_ms / 100) + 1):
        feed.heartbeat("p1", boot="A", snapshot_seq=1)  # alive, stuck on an old snapshot
        feed.tick()
    assert phase(feed, "a") == Phase.DRAINED
    assert feed.node("a").phase_cause == PhaseCause.DRAIN_DEADLINE


def test_a_removed_node_is_forgotten_when_the_last_proxy_acknowledges() -> None:
    feed = warm_pool("a", "b", "c")
    feed.heartbeat("p1", boot="A", snapshot_seq=feed.seq)
    feed.remove("a")
    feed.remove("b")
    assert feed.node("a").phase == feed.node("b").phase == Phase.DRAINING
    feed.heartbeat("p1", boot="A", snapshot_seq=feed.seq)
    assert set(feed.scheduler.state.nodes) == {"c"}
