"""`laswrr bench --scenario pd`: a prefill/decode pool's engines get their roles and protocol, a
peer router runs in its own P/D mode (vllm-router: vllm, sglang-router: sglang, each sglang
prefill node with its bootstrap port), and the drain action is the operator's drain alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

from laswrr.bench.scenarios import SCENARIOS, true_capacity_changes
from laswrr.bench.stack_adapter import pd_engine_args, pd_protocol_for, peer_workers
from laswrr.bench.virtual_timeline import check_timeline
from laswrr.collectors.nodes import Node

PD = SCENARIOS["pd"]


def test_each_row_runs_its_routers_protocol() -> None:
    assert [pd_protocol_for(PD, p) for p in ("la-swrr", "rr", "vllm-router:power_of_two",
                                              "sglang-router:cache_aware")] == ["vllm", "vllm", "vllm", "sglang"]
    assert pd_protocol_for(SCENARIOS["announced-drop"], "sglang-router:cache_aware") is None
    assert [pd_protocol_for(SCENARIOS["pd-sglang"], p) for p in ("la-swrr", "vllm-router:power_of_two")] == [
        "sglang", "vllm"]
    roles, args = pd_engine_args(PD, "vllm")
    assert roles["p1"] == {"role": "prefill", "pd_protocol": "vllm", "bootstrap_port": None}
    assert args["d2"] == ("--pd-role", "decode", "--pd-protocol", "vllm")
    roles, args = pd_engine_args(PD, "sglang")
    port = roles["p2"]["bootstrap_port"]
    assert isinstance(port, int) and args["p2"][-2:] == ("--bootstrap-port", str(port))
    assert roles["d1"]["bootstrap_port"] is None and "--bootstrap-port" not in args["d1"]
    _, args = pd_engine_args(PD, "vllm", local_prefill=True)  # la-swrr+decode-only: the decode engines prefill too
    assert args["d1"][-1] == "--pd-local-prefill" and "--pd-local-prefill" not in args["p1"]
    _, args = pd_engine_args(PD, "sglang", local_prefill=True)  # an sglang decode engine never does
    assert "--pd-local-prefill" not in args["d1"]


def test_a_peer_router_gets_its_pd_flags() -> None:
    nodes = [Node(id="p1", url="http://h:1", capacity=4, role="prefill", pd_protocol="sglang", bootstrap_port=9001),
             Node(id="d1", url="http://h:2", capacity=4, role="decode", pd_protocol="sglang")]
    assert peer_workers("sglang-router", nodes) == ["--pd-disaggregation", "--prefill", "http://h:1", "9001",
                                                     "--decode", "http://h:2"]
    vllm = [replace(nodes[0], pd_protocol="vllm", bootstrap_port=None), replace(nodes[1], pd_protocol="vllm")]
    assert peer_workers("vllm-router", vllm) == ["--vllm-pd-disaggregation", "--prefill", "http://h:1",
                                                  "--decode", "http://h:2"]
    whole = [Node(id="n1", url="http://h:3", capacity=4)]
    assert peer_workers("vllm-router", whole) == ["--worker-urls", "http://h:3"]


def test_the_drain_leaves_the_engine_and_its_true_capacity_alone() -> None:
    assert [a.kind for a in PD.actions] == ["slowdown", "drain"]
    assert true_capacity_changes(PD) == []
    with pytest.raises(ValueError, match="does not model prefill/decode pools"):
        check_timeline(PD)


def test_a_drain_line_says_how_long_after_the_nodes_own_last_attempt() -> None:
    from laswrr.bench.report import _drain_line

    base = {"node": "p2", "started_ts_ns": 1_000, "duration_ms": 1360.0, "after_last_attempt_ms": 0.0}
    assert _drain_line({**base, "by": "inflight", "last_attempt_ts_ns": 5_000, "later_legs": 2}) == (
        "p2 drained 1.36 s after the drain, 0 ms after its last attempt ended; 2 legs of its requests ended "
        "elsewhere after that")
    assert _drain_line({**base, "by": "inflight", "last_attempt_ts_ns": 900, "later_legs": 0}) == (
        "p2 drained 1.36 s after the drain (nothing was in flight on it)")
    assert _drain_line({**base, "by": "deadline", "last_attempt_ts_ns": 5_000, "later_legs": 0}) == (
        "p2 drained by the drain deadline 1.36 s after the drain")
    assert _drain_line({**base, "by": None, "last_attempt_ts_ns": None, "later_legs": None}) == (
        "p2 draining, not drained by the end of the run")
