"""Prefill/decode roles in the core (docs/proxy.md, "Prefill/decode pairs"): a
node's role and its pool's protocol come with its registration, reach the proxies in the
snapshot, and each role is weighed among its own members; a pool without roles keeps its bytes."""

from __future__ import annotations

from typing import Any

from sched_feed import Feed, rejections

from laswrr.scheduler.core import Scheduler
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import encode


def _register(feed: Feed, node: str, role: str | None = None, protocol: str | None = None,
              pool: str = "default", capacity: int = 10) -> list[str]:
    body: dict[str, Any] = {"url": f"http://{node}:8000", "pool": pool, "chip": "910B", "capacity": capacity}
    if role is not None:
        body["role"] = role
    if protocol is not None:
        body["pd_protocol"] = protocol
    return rejections(feed.send(sj.admin_node(node), body))


def test_a_prefill_or_decode_node_must_name_its_pools_protocol() -> None:
    feed = Feed()
    assert rejections(feed.send(sj.admin_node("p1"), {"url": "http://p1:8000", "capacity": 4, "role": "prefill"})) \
        == ["node 'p1' has role prefill: its registration must name the pool's pd_protocol (vllm or sglang)"]
    assert "p1" not in feed.scheduler.state.nodes
    reasons = rejections(feed.send(sj.admin_node("p1"), {"url": "http://p1:8000", "capacity": 4, "role": "leader"}))
    assert len(reasons) == 1 and "role" in reasons[0]  # an unknown role is the decoder's rejection


def test_roles_reach_the_snapshot_and_a_pool_speaks_one_protocol() -> None:
    feed = Feed()
    assert _register(feed, "p1", "prefill", "vllm") == []
    assert _register(feed, "d1", "decode", "vllm") == []
    assert _register(feed, "d2", "decode", "sglang") == [
        "node 'd2' names pd_protocol sglang but node 'p1' of pool 'default' names vllm: a pool's nodes speak one protocol"]
    assert _register(feed, "d2", "decode", "sglang", pool="other") == []  # another pool may speak another
    assert _register(feed, "b1") == []  # a both node in a P/D pool names no protocol
    views = {v["node"]: v for v in feed.snap()["nodes"]}
    assert (views["p1"]["role"], views["p1"]["pd_protocol"]) == ("prefill", "vllm")
    assert (views["d1"]["role"], views["d1"]["pd_protocol"]) == ("decode", "vllm")
    assert "role" not in views["b1"] and "pd_protocol" not in views["b1"]
    # the only node of a pool may change its protocol; a role change is applied in place
    assert _register(feed, "d2", "prefill", "vllm", pool="other") == []
    assert feed.view("d2", pool="other")["role"] == "prefill"
    restored = Scheduler.restore(feed.checkpoint())
    assert restored.state.nodes["p1"].role == "prefill" and restored.state.nodes["p1"].pd_protocol == "vllm"


def test_a_pool_without_roles_keeps_its_snapshot_bytes() -> None:
    plain, explicit = Feed(), Feed()
    for name in ("n1", "n2"):
        plain.register(name)
        _register(explicit, name, role="both")
    for feed in (plain, explicit):
        feed.engine("n1", running=3, waiting=1, kv=0.4, ttft_ms=300)
        feed.tick(5)
    assert encode(plain.scheduler.snapshot("default")) == encode(explicit.scheduler.snapshot("default"))
    assert b'"role"' not in encode(plain.scheduler.snapshot("default"))


def test_each_role_is_weighed_among_its_own_members() -> None:
    """A prefill leg's TTFT is the whole prompt's, a decode leg's one token's: weighed together the
    prefill nodes would look slow next to the decode nodes; apart each role's best is its reference."""
    def pool(roles: bool) -> Feed:
        feed = Feed()
        for name, role in (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode")):
            _register(feed, name, role if roles else None, "vllm" if roles else None)
        feed.tick(30)
        for _ in range(5):
            for name, ttft in (("p1", 2000.0), ("p2", 2000.0), ("d1", 50.0)):
                feed.engine(name, running=0, waiting=0, kv=0.0, ttft_ms=ttft)
            feed.tick(10)
        return feed

    apart, together = pool(True), pool(False)
    assert apart.node("p1").target == apart.node("d1").target > 0  # each the best of its role
    assert together.node("p1").target < together.node("d1").target


def test_a_prefill_node_is_weighed_on_the_prompt_work_of_its_legs() -> None:
    """Prefill legs count their prompt tokens only (the work waiting on the node), so a node with
    one long prompt in prefill weighs more than one whose leg has a short prompt and a long output
    (the decode node's work, not its); a decode leg still counts its prompt and output."""
    feed = Feed()
    for name, role in (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode")):
        _register(feed, name, role, "vllm")
    feed.tick(30)
    for k in range(6):
        feed.start("p1", request_id=f"a{k}", prompt_tokens=8000, max_tokens=100, role="prefill")
        feed.start("p2", request_id=f"b{k}", prompt_tokens=100, max_tokens=8000, role="prefill")
        feed.start("d1", request_id=f"a{k}.d", prompt_tokens=8000, max_tokens=100, role="decode")
        feed.start("d2", request_id=f"b{k}.d", prompt_tokens=100, max_tokens=8000, role="decode")
    for name in ("p1", "p2", "d1", "d2"):
        feed.engine(name, running=6, waiting=0, kv=0.0, ttft_ms=100)
    feed.tick(10)
    assert [feed.scheduler.state.nodes[n].inflight_tokens for n in ("p1", "p2", "d1", "d2")] == [
        48000, 600, 48600, 48600]
    running = {n: feed.view(n)["load"]["running"] for n in ("p1", "p2", "d1", "d2")}
    assert running["p1"] > running["p2"] and running["d1"] == running["d2"]
    assert feed.node("p1").target < feed.node("p2").target


def test_a_drained_prefill_node_is_drained_when_its_own_legs_end() -> None:
    feed = Feed()
    _register(feed, "p1", "prefill", "vllm")
    _register(feed, "p2", "prefill", "vllm")
    _register(feed, "d1", "decode", "vllm")
    feed.tick(30)
    prefill_leg = feed.start("p1", request_id="r1")
    decode_leg = feed.start("d1", request_id="r1.d")  # the decode legs of other requests go on
    feed.drain("p1")
    assert feed.phase("p1") == "draining"
    feed.finish("p1", prefill_leg)
    assert feed.phase("p1") == "drained" and feed.node("d1").inflight == 1
    feed.finish("d1", decode_leg)


def test_an_sglang_prefill_node_registers_its_bootstrap_port() -> None:
    feed = Feed()
    body = {"url": "http://p1:30000", "capacity": 4, "role": "prefill", "pd_protocol": "sglang"}
    assert rejections(feed.send(sj.admin_node("p1"), body)) == [
        "node 'p1' is an sglang prefill node: its registration must name its bootstrap_port "
        "(the engine's --disaggregation-bootstrap-port)"]
    assert rejections(feed.send(sj.admin_node("d1"), {"url": "http://d1:30000", "capacity": 4, "role": "decode",
                                                      "pd_protocol": "sglang", "bootstrap_port": 8998})) == [
        "node 'd1' names bootstrap_port but only an sglang prefill node has one (role decode, pd_protocol sglang)"]
    assert len(rejections(feed.send(sj.admin_node("p1"), {**body, "bootstrap_port": 70000}))) == 1  # not a port
    assert rejections(feed.send(sj.admin_node("p1"), {**body, "bootstrap_port": 8998})) == []
    assert _register(feed, "d1", "decode", "sglang") == []
    assert feed.view("p1")["bootstrap_port"] == 8998 and "bootstrap_port" not in feed.view("d1")
    restored = Scheduler.restore(feed.checkpoint())
    assert restored.state.nodes["p1"].bootstrap_port == 8998


def test_a_decode_node_joining_a_warm_pool_slow_starts_among_its_role() -> None:
    """Slow start per node and role: a decode node registered into a warm P/D pool starts
    recovering and ramps up among the decode nodes; the prefill nodes' weights do not move, and a
    drained decode node is drained when its own decode legs end."""
    feed = Feed()
    for name, role in (("p1", "prefill"), ("d1", "decode")):
        _register(feed, name, role, "vllm")
    feed.ticks_until(feed.scheduler.config.slow_start_window_ms + 1000)
    prefill_weight = feed.view("p1")["effective_weight"]
    _register(feed, "d2", "decode", "vllm")
    assert feed.phase("d2") == "recovering"
    first = feed.view("d2")["effective_weight"]
    assert 0 < first < feed.view("d1")["effective_weight"]
    feed.ticks_until(feed.scheduler.config.slow_start_window_ms // 2)
    assert first < feed.view("d2")["effective_weight"] and feed.view("p1")["effective_weight"] == prefill_weight
    feed.ticks_until(feed.scheduler.config.slow_start_window_ms)
    assert feed.phase("d2") == "active"
    assert feed.view("d2")["effective_weight"] == feed.view("d1")["effective_weight"]
    leg = feed.start("d2", request_id="r1.1")
    feed.drain("d2")
    assert feed.phase("d2") == "draining" and not feed.view("d2")["routable"]
    feed.finish("d2", leg)
    assert feed.phase("d2") == "drained"
