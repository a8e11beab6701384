"""The collector's node set: nodes.toml first, then lb.admin.node / lb.admin.remove in log order,
each registration followed only once a weight snapshot shows the scheduler applied it."""

from __future__ import annotations

import json

from laswrr.collectors.nodes import Node
from laswrr.collectors.npu import ChipSelector
from laswrr.collectors.registrations import RegisteredNodes
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import encode
from laswrr.schemas.outputs import LoadView, NodeView, WeightSnapshot
from laswrr.schemas.words import Phase

FILE_NODE = Node(id="n1", url="http://10.0.0.1:1025", metrics_url="http://10.0.0.1:1027/metrics",
                 health_url="http://10.0.0.1:1026/health", engine="mindie", npu_smi="npu-smi info",
                 selector=ChipSelector(npu_ids=(0,)))


def node_msg(node: str, **body: object) -> tuple[str, bytes]:
    return sj.admin_node(node), json.dumps({"capacity": 4, **body}).encode()


def snapshot(*nodes: tuple[str, str], inflight: dict[str, int] | None = None, pool: str = "default") -> bytes:
    load = LoadView(queue=0, running=0, kv=0, npu=0, latency=0, load=0, sample_age_ms=None, stale=False)
    views = [NodeView(node=n, url=u, phase=Phase.ACTIVE, routable=True, capacity=4, target_weight=4,
                      effective_weight=4, inflight=(inflight or {}).get(n, 0), chip="c", health=1, load=load)
             for n, u in nodes]
    return encode(WeightSnapshot(pool=pool, as_of_seq=1, tick=1, ts_ns=1, panic=False, nodes=views))


def test_busy_is_the_nodes_with_requests_in_flight_in_their_pools_latest_snapshot() -> None:
    nodes = RegisteredNodes()
    nodes.observe_snapshot("a", snapshot(("n1", "http://h:1"), ("n2", "http://h:2"), inflight={"n2": 3}, pool="a"))
    nodes.observe_snapshot("b", snapshot(("n3", "http://h:3"), inflight={"n3": 1}, pool="b"))
    assert nodes.busy == {"n2", "n3"}
    nodes.observe_snapshot("a", snapshot(("n1", "http://h:1"), ("n2", "http://h:2"), pool="a"))  # n2's ended
    assert nodes.busy == {"n3"}
    nodes.observe_snapshot("b", None)  # the pool is gone
    assert nodes.busy == set()


def test_a_runtime_registration_is_polled_once_a_snapshot_shows_it_applied() -> None:
    nodes = RegisteredNodes()
    assert nodes.observe(*node_msg("n5", url="http://10.0.0.5:8000/", metrics_url="http://10.0.0.5:9000/m",
                                   engine="sglang")) == []  # asked, not applied yet
    assert nodes.nodes == {}
    change = nodes.observe_snapshot("default", snapshot(("n5", "http://10.0.0.5:8000/")))
    assert change == [("n5", Node(id="n5", url="http://10.0.0.5:8000", chip="unknown", capacity=4,
                                  metrics_url="http://10.0.0.5:9000/m", health_url="http://10.0.0.5:8000/health",
                                  engine="sglang"))]
    assert list(nodes.nodes) == ["n5"]


def test_a_registration_the_scheduler_rejected_is_never_polled() -> None:
    nodes = RegisteredNodes()
    nodes.observe_snapshot("default", snapshot(("n1", "http://127.0.0.1:9001")))  # another node, applied
    assert nodes.observe(*node_msg("evil", url="http://203.0.113.9:8000")) == []  # refused: not in any snapshot
    assert nodes.observe_snapshot("default", snapshot(("n1", "http://127.0.0.1:9001"))) == []
    assert "evil" not in nodes.nodes


def test_a_rejected_re_registration_keeps_the_applied_polling() -> None:
    nodes = RegisteredNodes()
    nodes.observe(*node_msg("n5", url="http://10.0.0.5:8000"))
    nodes.observe_snapshot("default", snapshot(("n5", "http://10.0.0.5:8000")))
    assert nodes.observe(*node_msg("n5", url="http://203.0.113.9:8000")) == []  # the scheduler keeps the old URL
    assert nodes.observe_snapshot("default", snapshot(("n5", "http://10.0.0.5:8000"))) == []
    assert nodes.nodes["n5"].url == "http://10.0.0.5:8000"


def test_the_same_registration_again_changes_nothing_and_remove_stops() -> None:
    nodes = RegisteredNodes()
    nodes.observe(*node_msg("n5", url="http://10.0.0.5:8000"))
    nodes.observe_snapshot("default", snapshot(("n5", "http://10.0.0.5:8000")))
    assert nodes.observe(*node_msg("n5", url="http://10.0.0.5:8000")) == []
    assert nodes.observe(sj.admin_remove("n5"), b"{}") == [("n5", None)]
    assert nodes.observe(sj.admin_remove("n5"), b"{}") == []  # already gone
    assert nodes.observe_snapshot("default", snapshot()) == []  # forgotten after its drain
    assert nodes.nodes == {}


def test_a_node_forgotten_by_the_scheduler_stops_being_polled() -> None:
    nodes = RegisteredNodes()
    nodes.observe(*node_msg("n5", url="http://10.0.0.5:8000"))
    nodes.observe_snapshot("default", snapshot(("n5", "http://10.0.0.5:8000")))
    assert nodes.observe_snapshot("default", None) == [("n5", None)]  # the pool's key was deleted


def test_a_new_capacity_is_kept_but_does_not_restart_polling() -> None:
    nodes = RegisteredNodes()
    nodes.observe(*node_msg("n5", url="http://10.0.0.5:8000"))
    nodes.observe_snapshot("default", snapshot(("n5", "http://10.0.0.5:8000")))
    assert nodes.observe(sj.admin_node("n5"), b'{"url": "http://10.0.0.5:8000", "capacity": 9}') == []
    assert nodes.nodes["n5"].capacity == 9


def test_a_file_node_keeps_its_urls_and_npu_settings_when_registered_at_its_url() -> None:
    nodes = RegisteredNodes([FILE_NODE])
    assert list(nodes.nodes) == ["n1"]  # polled from the start
    nodes.observe(*node_msg("n1", url="http://10.0.0.1:1025"))
    assert nodes.observe_snapshot("default", snapshot(("n1", "http://10.0.0.1:1025"))) == []  # as the file says
    assert nodes.observe(*node_msg("n1", url="http://10.0.0.9:1025")) == []  # not applied yet
    moved = nodes.observe_snapshot("default", snapshot(("n1", "http://10.0.0.9:1025")))
    assert moved == [("n1", Node(
        id="n1", url="http://10.0.0.9:1025", chip="unknown", capacity=4, metrics_url="http://10.0.0.9:1025/metrics",
        health_url="http://10.0.0.9:1025/health", engine="mindie", npu_smi="npu-smi info",
        selector=ChipSelector(npu_ids=(0,))))]


def test_what_the_scheduler_would_reject_or_other_subjects_change_nothing() -> None:
    nodes = RegisteredNodes([FILE_NODE])
    for subject, data in (node_msg("n6", url="http://x:1", engine="tgi"), node_msg("n6", url="http://x:1",
                          metrics_url="ftp://x/m"), (sj.admin_node("n6"), b"not json"),
                          (sj.admin_capacity("n1"), b'{"capacity": 0}'), (sj.admin_node("n6"), b'{"url": "http://x:1"}')):
        assert nodes.observe(subject, data) == [], data
    assert nodes.observe_snapshot("default", b"not json") == []
    assert list(nodes.nodes) == ["n1"]
