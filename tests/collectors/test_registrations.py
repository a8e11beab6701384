"""The collector's node set: nodes.toml first, then lb.admin.node / lb.admin.remove in log order."""

from __future__ import annotations

import json

from laswrr.collectors.nodes import Node
from laswrr.collectors.npu import ChipSelector
from laswrr.collectors.registrations import RegisteredNodes
from laswrr.schemas import subjects as sj

FILE_NODE = Node(id="n1", url="http://10.0.0.1:1025", metrics_url="http://10.0.0.1:1027/metrics",
                 health_url="http://10.0.0.1:1026/health", engine="mindie", npu_smi="npu-smi info",
                 selector=ChipSelector(npu_ids=(0,)))


def node_msg(node: str, **body: object) -> tuple[str, bytes]:
    return sj.admin_node(node), json.dumps({"capacity": 4, **body}).encode()


def test_a_runtime_registration_starts_polling_with_the_given_urls() -> None:
    nodes = RegisteredNodes()
    change = nodes.observe(*node_msg("n5", url="http://10.0.0.5:8000/", metrics_url="http://10.0.0.5:9000/m",
                                     engine="sglang"))
    assert change == ("n5", Node(id="n5", url="http://10.0.0.5:8000", chip="unknown", capacity=4,
                                 metrics_url="http://10.0.0.5:9000/m", health_url="http://10.0.0.5:8000/health",
                                 engine="sglang"))
    assert list(nodes.nodes) == ["n5"]


def test_the_same_registration_again_changes_nothing_and_remove_stops() -> None:
    nodes = RegisteredNodes()
    nodes.observe(*node_msg("n5", url="http://10.0.0.5:8000"))
    assert nodes.observe(*node_msg("n5", url="http://10.0.0.5:8000")) is None
    assert nodes.observe(sj.admin_remove("n5"), b"{}") == ("n5", None)
    assert nodes.observe(sj.admin_remove("n5"), b"{}") is None  # already gone
    assert nodes.nodes == {}


def test_a_new_capacity_is_kept_but_does_not_restart_polling() -> None:
    nodes = RegisteredNodes()
    nodes.observe(*node_msg("n5", url="http://10.0.0.5:8000"))
    assert nodes.observe(sj.admin_node("n5"), b'{"url": "http://10.0.0.5:8000", "capacity": 9}') is None
    assert nodes.nodes["n5"].capacity == 9


def test_a_file_node_keeps_its_urls_and_npu_settings_when_registered_at_its_url() -> None:
    nodes = RegisteredNodes([FILE_NODE])
    assert nodes.observe(*node_msg("n1", url="http://10.0.0.1:1025")) is None  # what the file says already
    moved = nodes.observe(*node_msg("n1", url="http://10.0.0.9:1025"))
    assert moved is not None and moved[1] == Node(
        id="n1", url="http://10.0.0.9:1025", chip="unknown", capacity=4, metrics_url="http://10.0.0.9:1025/metrics",
        health_url="http://10.0.0.9:1025/health", engine="mindie", npu_smi="npu-smi info",
        selector=ChipSelector(npu_ids=(0,)))


def test_what_the_scheduler_would_reject_or_other_subjects_change_nothing() -> None:
    nodes = RegisteredNodes([FILE_NODE])
    for subject, data in (node_msg("n6", url="http://x:1", engine="tgi"), node_msg("n6", url="http://x:1",
                          metrics_url="ftp://x/m"), (sj.admin_node("n6"), b"not json"),
                          (sj.admin_capacity("n1"), b'{"capacity": 0}'), (sj.admin_node("n6"), b'{"url": "http://x:1"}')):
        assert nodes.observe(subject, data) is None, data
    assert list(nodes.nodes) == ["n1"]
