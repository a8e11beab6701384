"""The upstream allow-list: which lb.admin.node URLs the pure core applies, and the recorded reason otherwise."""

from __future__ import annotations

import json

import pytest

from laswrr.scheduler.config import SchedulerConfig, with_changes
from laswrr.scheduler.upstreams import upstream_rejection
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import SchemaError

from tests.scheduler.sched_feed import Feed

ALLOWED = ("10.0.0.0/8", "engine-1.lan", "gpu.example:9000", "[fd00::1]:8000")


@pytest.mark.parametrize("url", [
    "http://10.1.2.3:8000", "https://10.255.0.1", "http://ENGINE-1.lan:1234/v1", "http://gpu.example:9000",
    "http://[fd00::1]:8000",
])
def test_allowed_hosts(url: str) -> None:
    assert upstream_rejection(url, ALLOWED) is None


@pytest.mark.parametrize(("url", "words"), [
    ("http://11.0.0.1:8000", "not in the allow-list"),
    ("http://gpu.example:9001", "gpu.example:9001 is not in the allow-list"),
    ("http://gpu.example", "gpu.example:80 is not in the allow-list"),
    ("http://engine-1.lan.evil.com", "not in the allow-list"),
    ("http://[fd00::1]:8001", "not in the allow-list"),
    ("http://localhost:8000", "not in the allow-list"),  # a name is never resolved into a CIDR block
])
def test_refused_hosts(url: str, words: str) -> None:
    reason = upstream_rejection(url, ALLOWED)
    assert reason is not None and words in reason


@pytest.mark.parametrize(("url", "words"), [
    ("http://user:pw@10.0.0.1:8000", "user info"), ("http://10.0.0.1:8000/?x=1", "query or a fragment"),
    ("http://10.0.0.1:8000/#frag", "query or a fragment"), ("ftp://10.0.0.1", "http:// or https://"),
    ("10.0.0.1:8000", "http:// or https://"), ("http://[::1", "does not parse"),
])
def test_always_refused_even_with_an_empty_list(url: str, words: str) -> None:
    for allowed in ((), ALLOWED):
        reason = upstream_rejection(url, allowed)
        assert reason is not None and words in reason, (url, allowed, reason)


def test_an_empty_list_allows_any_host() -> None:
    assert upstream_rejection("http://169.254.169.254/latest", ()) is None


@pytest.mark.parametrize("pattern", ["10.0.0.0/33", "host:port", "a b", "user@host", "host:0"])
def test_a_bad_pattern_is_a_configuration_error(pattern: str) -> None:
    with pytest.raises(SchemaError, match="allow_upstream"):
        with_changes(SchedulerConfig(), {"allow_upstream": f"10.0.0.1,{pattern}"})


def test_core_records_the_reason_and_applies_nothing() -> None:
    feed = Feed(SchedulerConfig(allow_upstream="10.0.0.0/8"))
    outputs = feed.send(sj.admin_node("evil"), {"url": "http://169.254.169.254:80", "capacity": 4})
    assert [o.subject for o in outputs] == [sj.OUT_REJECTED]
    rejected = json.loads(outputs[0].data)
    assert rejected["as_of_seq"] == 1 and "169.254.169.254:80 is not in the allow-list (10.0.0.0/8)" in rejected["reason"]
    assert "evil" not in feed.scheduler.state.nodes
    applied = feed.send(sj.admin_node("n1"), {"url": "http://10.0.0.5:8000", "capacity": 4})
    assert sj.OUT_REJECTED not in [o.subject for o in applied] and "n1" in feed.scheduler.state.nodes


def test_the_allow_list_is_an_event_so_replay_sees_it() -> None:
    feed = Feed()
    feed.send(sj.ADMIN_CONFIG, {"set": {"allow_upstream": "10.0.0.0/8"}})
    outputs = feed.send(sj.admin_node("n1"), {"url": "http://192.168.1.5:8000", "capacity": 4})
    assert [o.subject for o in outputs] == [sj.OUT_REJECTED]
    again = feed.send(sj.admin_node("n1"), {"url": "http://10.0.0.5:8000", "capacity": 4,
                                            "metrics_url": "http://192.168.1.5:9100/metrics"})
    assert "metrics_url" not in json.loads(again[0].data)["reason"] and "192.168.1.5:9100" in json.loads(again[0].data)["reason"]
    # a re-registration of a known node is checked too: it would move the node's traffic
    feed.send(sj.admin_node("n2"), {"url": "http://10.0.0.6:8000", "capacity": 4})
    moved = feed.send(sj.admin_node("n2"), {"url": "http://8.8.8.8:8000", "capacity": 4})
    assert [o.subject for o in moved] == [sj.OUT_REJECTED]
    assert feed.scheduler.state.nodes["n2"].url == "http://10.0.0.6:8000"
