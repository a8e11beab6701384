"""The snapshot's ``proxy_inflight``: each proxy's share of every node's in-flight count.

A proxy routes on ``inflight - proxy_inflight[itself] + its own live count`` (the pool-wide
view, scheduler/routing/load.py), so the split must add up to ``inflight`` exactly, follow
every way a request ends (finished, voided by a heartbeat, a new boot id, the proxy stopping or
expiring, the node removed), stay sorted (replicas emit the same bytes), and be left out when no
request is open, so the snapshots of such states are the bytes the core emitted before.
"""

from __future__ import annotations


from laswrr.schemas import subjects as sj
from tests.scheduler.sched_feed import Feed, warm_pool


def split(feed: Feed, pool: str = "default") -> dict[str, dict[str, int]]:
    return feed.snap(pool).get("proxy_inflight", {})


def assert_adds_up(feed: Feed, pool: str = "default") -> None:
    snap = feed.snap(pool)
    by_node: dict[str, int] = {}
    for counts in snap.get("proxy_inflight", {}).values():
        for node, n in counts.items():
            assert n > 0
            by_node[node] = by_node.get(node, 0) + n
    assert by_node == {v["node"]: v["inflight"] for v in snap["nodes"] if v["inflight"]}


def test_the_split_follows_starts_and_finishes_per_proxy_and_node() -> None:
    feed = warm_pool("a", "b")
    assert "proxy_inflight" not in feed.snap()  # nothing open: the field is left out
    a1 = feed.start("a", proxy="p2")
    feed.start("a", proxy="p1")
    feed.start("b", proxy="p1")
    feed.start("a", proxy="p1")
    assert split(feed) == {"p1": {"a": 2, "b": 1}, "p2": {"a": 1}}
    assert list(split(feed)) == ["p1", "p2"]  # sorted, whatever the order of arrival
    assert_adds_up(feed)
    feed.finish("a", a1, proxy="p2")
    assert split(feed) == {"p1": {"a": 2, "b": 1}}
    assert_adds_up(feed)


def test_every_way_a_request_ends_leaves_the_split_equal_to_inflight() -> None:
    feed = warm_pool("a", "b")
    for _ in range(3):
        feed.start("a", proxy="p1", boot="A")
        feed.start("b", proxy="p2", boot="X")
        feed.start("a", proxy="p3", boot="Q")
    feed.heartbeat("p1", inflight=1, boot="A")  # two of p1's finished events were lost
    assert split(feed)["p1"] == {"a": 1}
    assert_adds_up(feed)
    feed.start("b", proxy="p2", boot="Y")  # p2 restarted: its old process's requests are void
    assert split(feed)["p2"] == {"b": 1}
    assert_adds_up(feed)
    feed.send(sj.proxy_stopped("p3"), {"boot_id": "Q"})
    assert "p3" not in split(feed)
    assert_adds_up(feed)
    feed.config(proxy_timeout_ms=1000)
    feed.tick(20)  # p1 and p2 fall silent: expired
    assert "proxy_inflight" not in feed.snap()
    assert_adds_up(feed)


def test_a_removed_node_leaves_the_split() -> None:
    feed = warm_pool("a", "b")
    feed.start("a", proxy="p1")
    feed.start("b", proxy="p1")
    feed.config(drain_deadline_ms=100)
    feed.remove("a")
    feed.tick(3)  # the drain deadline passes with one in flight: removed
    assert "a" not in {v["node"] for v in feed.snap()["nodes"]}
    assert split(feed) == {"p1": {"b": 1}}
    assert_adds_up(feed)


def test_each_pool_carries_only_its_own_nodes() -> None:
    feed = Feed()
    feed.register("a", pool="x")
    feed.register("b", pool="y")
    feed.tick(5)
    feed.start("a", proxy="p1")
    feed.start("b", proxy="p1")
    assert split(feed, "x") == {"p1": {"a": 1}} and split(feed, "y") == {"p1": {"b": 1}}


def test_a_scheduler_restored_from_a_checkpoint_carries_the_same_split() -> None:
    from laswrr.scheduler.core import Scheduler

    feed = warm_pool("a", "b")
    ids = [feed.start("a", proxy="p1"), feed.start("b", proxy="p2"), feed.start("a", proxy="p2")]
    restored = Feed(scheduler=Scheduler.restore(feed.checkpoint()))
    restored.seq, restored.ts_ns = feed.seq, feed.ts_ns
    assert split(restored) == split(feed) == {"p1": {"a": 1}, "p2": {"a": 1, "b": 1}}
    restored.finish("a", ids[0], proxy="p1")  # the derived counts follow the restored state
    assert split(restored) == {"p2": {"a": 1, "b": 1}}
    assert_adds_up(restored)
