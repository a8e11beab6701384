"""The routing table, pure: newest snapshot wins, candidates, tried set, caps, seeds, release."""

from __future__ import annotations

import pytest

from laswrr.schemas.outputs import LoadView, NodeView, WeightSnapshot
from tests.scheduler.routing_help import admit
from laswrr.services.proxy.config import parse_size, seed_of
from laswrr.scheduler.routing.router import Router
from laswrr.services.proxy.transport import engine_url
from laswrr.services.proxy.upstream import usage_from_json, usage_from_sse

LOAD = LoadView(queue=0, running=0, kv=0, npu=0, latency=0, load=0, sample_age_ms=None, stale=False)


def node(name: str, weight: float, routable: bool = True, capacity: int = 4, url: str | None = None) -> NodeView:
    return NodeView(node=name, url=url or f"http://{name}:8000", phase="active" if routable else "draining",
                    routable=routable, capacity=capacity, target_weight=weight, effective_weight=weight,
                    inflight=0, chip="910B", health=1.0, load=LOAD)


def snap(seq: int, *nodes: NodeView, pool: str = "default") -> WeightSnapshot:
    return WeightSnapshot(pool=pool, as_of_seq=seq, tick=seq, ts_ns=0, panic=False, nodes=list(nodes))


def test_an_older_snapshot_never_replaces_a_newer_one() -> None:
    router = Router("rr", seed=1)
    assert router.table.offer(snap(5, node("a", 1)), now=0)
    assert not router.table.offer(snap(4, node("b", 1)), now=1)
    assert not router.table.offer(snap(5, node("b", 1)), now=1)
    assert list(router.table.route("default").first.targets) == ["a"]
    assert router.table.offer(snap(6, node("b", 1)), now=2)
    assert list(router.table.route("default").first.targets) == ["b"]


def test_after_a_new_stream_each_pool_takes_its_next_snapshot_once() -> None:
    router = Router("rr", seed=1)
    router.table.offer(snap(500, node("a", 1)), now=0)
    router.table.offer(snap(700, node("a", 1), pool="other"), now=0)
    router.table.new_stream()
    assert list(router.table.route("default").first.targets) == ["a"]  # still routing on the old one meanwhile
    assert router.table.offer(snap(1, node("b", 1)), now=1)  # the new stream counts from 1
    assert not router.table.offer(snap(1, node("c", 1)), now=1)  # and newest wins again within it
    assert list(router.table.route("default").first.targets) == ["b"]
    assert router.table.route("other").superseded and not router.table.route("default").superseded


def test_only_routable_nodes_with_weight_are_candidates() -> None:
    router = Router("la-swrr", seed=0)
    router.table.offer(snap(1, node("a", 2), node("b", 0), node("c", 3, routable=False)), now=0)
    picks = set()
    for _ in range(20):
        admission = admit(router, "default")
        assert admission is not None
        picks.add(admission.node)
        router.admitter.release(admission)
    assert picks == {"a"}


def test_la_swrr_follows_weights_and_binds_url_at_admission() -> None:
    router = Router("la-swrr", seed=0)
    router.table.offer(snap(1, node("a", 5), node("b", 1), node("c", 1)), now=0)
    admissions = [admit(router, "default") for _ in range(7)]
    assert sorted(a.node for a in admissions if a) == ["a"] * 5 + ["b", "c"]  # one SWRR period
    first = admissions[0]
    assert first is not None and first.url == f"http://{first.node}:8000" and first.snapshot_seq == 1
    router.table.offer(snap(2, node("a", 5, url="http://moved:1"), node("b", 1)), now=1)
    assert first.url == f"http://{first.node}:8000"  # the admitted request keeps its node
    assert router.table.load.total == 7
    for admission in admissions:
        assert admission is not None
        router.admitter.release(admission)
    assert router.table.load.own == {} and router.table.load.total == 0


def test_tried_nodes_are_excluded_and_exhaustion_returns_none() -> None:
    router = Router("la-swrr", seed=3)
    router.table.offer(snap(1, node("a", 1), node("b", 1)), now=0)
    first = admit(router, "default")
    assert first is not None
    second = admit(router, "default", tried=[first.node])
    assert second is not None and second.node != first.node
    assert admit(router, "default", tried=["a", "b"]) is None
    assert admit(router, "other") is None


def test_inflight_cap_is_ceil_of_factor_times_capacity() -> None:
    router = Router("least-request", seed=0, inflight_cap_per_capacity=0.5)
    router.table.offer(snap(1, node("a", 1, capacity=3), node("b", 1, capacity=1)), now=0)
    held = [admit(router, "default") for _ in range(3)]  # caps: a ceil(1.5) = 2, b ceil(0.5) = 1
    assert sorted(h.node for h in held if h) == ["a", "a", "b"]
    assert admit(router, "default") is None
    assert held[0] is not None
    router.admitter.release(held[0])
    assert admit(router, "default") is not None


def test_replicas_with_different_ids_do_not_move_in_lockstep() -> None:
    weights = [node(n, 1) for n in "abcdefgh"]
    firsts = set()
    for proxy_id in ("proxy-1", "proxy-2", "proxy-3", "proxy-4"):
        router = Router("la-swrr", seed=seed_of(proxy_id))
        router.table.offer(snap(1, *weights), now=0)
        admission = admit(router, "default")
        assert admission is not None
        firsts.add(admission.node)
    assert len(firsts) > 1
    assert seed_of("proxy-1") == seed_of("proxy-1") != seed_of("proxy-2")


def test_unknown_policy_fails_fast() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        Router("fastest", seed=0)


def test_helpers() -> None:
    assert engine_url("http://e:1/", "/v1/models") == "http://e:1/v1/models"
    assert engine_url("http://e:1/v1", "/v1/chat/completions?x=1") == "http://e:1/v1/chat/completions?x=1"
    assert usage_from_json(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 4}}') == (3, 4)
    assert usage_from_json(b"not json") == (None, None)
    sse = (b'data: {"choices": [], "usage": null}\n\n'
           b'data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}\n\ndata: [DONE]\n\n')
    assert usage_from_sse(sse) == (9, 2)
    assert usage_from_sse(b'data: {"choices": []}\n\ndata: [DONE]\n\n') == (None, None)
    assert parse_size("4MiB") == 4 << 20 and parse_size("1000") == 1000
    with pytest.raises(ValueError):
        parse_size("lots")
