"""A vllm P/D pool in the pure routing core: the first pick is the prefill leg's (LA-SWRR on the
prefill nodes' weights, with prefix affinity), the decode pick the decode role's own LA-SWRR (an
sglang pool the same); and the protocols' leg bodies (scheduler/routing/pd.py)."""

from __future__ import annotations

import json
from collections import Counter

import msgspec
import pytest

from laswrr.scheduler.routing import pd
from tests.scheduler.routing_help import admit
from laswrr.scheduler.routing.prompt import prompt_text, request_size
from laswrr.schemas.words import RefusalCause
from laswrr.scheduler.routing.latency import LatencyModel, Objective
from laswrr.scheduler.routing.router import DEFAULT_POOL, AdmitRequest, Admission, Refusal, Router
from laswrr.schemas.outputs import LoadView, NodeView, WeightSnapshot
from laswrr.schemas.words import NodeRole, PdProtocol

LOAD = LoadView(queue=0, running=0, kv=0, npu=0, latency=0, load=0, sample_age_ms=None, stale=False)


def view(name: str, weight: float, role: NodeRole | None, protocol: PdProtocol | None = PdProtocol.VLLM,
         routable: bool = True) -> NodeView:
    extra = {} if role is None else {"role": role, "pd_protocol": protocol}
    return NodeView(node=name, url=f"http://{name}:8000", phase="active" if routable else "draining",
                    routable=routable, capacity=8, target_weight=weight, effective_weight=weight if routable else 0.0,
                    inflight=0, chip="910B", health=1.0, load=LOAD, **extra)  # type: ignore[arg-type]


def snap(seq: int, *nodes: NodeView) -> WeightSnapshot:
    return WeightSnapshot(pool=DEFAULT_POOL, as_of_seq=seq, tick=seq, ts_ns=0, panic=False, nodes=list(nodes))


def pd_pool(router: Router, p2_routable: bool = True) -> None:
    router.table.offer(snap(1, view("p1", 6.0, NodeRole.PREFILL), view("p2", 2.0, NodeRole.PREFILL, routable=p2_routable),
                      view("d1", 3.0, NodeRole.DECODE), view("d2", 1.0, NodeRole.DECODE)), now=0.0)


def test_a_pair_is_a_prefill_pick_and_a_decode_pick_each_on_its_roles_weights() -> None:
    router = Router("la-swrr", seed=1, scorer=None)
    pd_pool(router)
    prefills, decodes = Counter[str](), Counter[str]()
    for _ in range(80):
        first = admit(router, DEFAULT_POOL)
        second = admit(router, DEFAULT_POOL, role=NodeRole.DECODE)
        assert first is not None and second is not None
        assert (first.role, second.role) == (NodeRole.PREFILL, NodeRole.DECODE)
        prefills[first.node] += 1
        decodes[second.node] += 1
        router.admitter.release(first)
        router.admitter.release(second)
    assert prefills == {"p1": 60, "p2": 20} and decodes == {"d1": 60, "d2": 20}  # 6:2 and 3:1, smooth WRR


def test_retries_and_refusals_stay_within_a_role() -> None:
    router = Router("la-swrr", seed=1, scorer=None)
    pd_pool(router, p2_routable=False)
    first = admit(router, DEFAULT_POOL)
    assert first is not None and first.node == "p1"
    assert admit(router, DEFAULT_POOL, tried=["p1"]) is None  # p2 draining: no other prefill node
    assert router.admitter.admit(AdmitRequest(DEFAULT_POOL, ["p1"])) == Refusal(RefusalCause.NO_ROUTABLE_NODE)
    decode = admit(router, DEFAULT_POOL, tried=["d1"], role=NodeRole.DECODE)
    assert decode is not None and decode.node == "d2"


def test_a_pool_without_roles_admits_whole_requests_and_an_sglang_pool_pairs() -> None:
    plain = Router("la-swrr", seed=1)
    plain.table.offer(snap(1, view("n1", 1.0, None), view("n2", 1.0, None)), now=0.0)
    whole = admit(plain, DEFAULT_POOL)
    assert whole is not None and whole.role is None and whole.protocol is None
    assert admit(plain, DEFAULT_POOL, role=NodeRole.DECODE) is None
    sglang = Router("la-swrr", seed=1)  # its both node is picked by neither role
    prefill_view = msgspec.structs.replace(view("p1", 5.0, NodeRole.PREFILL, PdProtocol.SGLANG), bootstrap_port=8998)
    sglang.table.offer(snap(1, prefill_view, view("d1", 5.0, NodeRole.DECODE, PdProtocol.SGLANG), view("b1", 1.0, None)),
                 now=0.0)
    firsts = [admit(sglang, DEFAULT_POOL) for _ in range(5)]
    assert {(a.node, a.role, a.protocol, a.bootstrap_port) for a in firsts if a is not None} == {
        ("p1", NodeRole.PREFILL, PdProtocol.SGLANG, 8998)}
    decodes = [admit(sglang, DEFAULT_POOL, role=NodeRole.DECODE) for _ in range(5)]
    assert {(a.node, a.role, a.bootstrap_port) for a in decodes if a is not None} == {("d1", NodeRole.DECODE, None)}


def test_prefix_affinity_applies_to_the_prefill_pick() -> None:
    router = Router("la-swrr", seed=1)
    pd_pool(router)
    raw = prompt_text(None, "the same long system prompt " * 200)
    size = request_size(raw, 8, None)
    first = admit(router, DEFAULT_POOL, prompt=raw, size=size)
    assert first is not None
    router.admitter.release(first)
    again = [admit(router, DEFAULT_POOL, prompt=raw, size=size) for _ in range(3)]
    assert {a.node for a in again if a is not None} == {first.node}  # the node holding the prompt's prefix


def test_the_legs_bodies() -> None:
    body = b'{"model":"m","prompt":"hi","max_tokens":64,"stream":true,"stream_options":{"include_usage":true}}'
    prefill = json.loads(pd.prefill_body(body))
    assert prefill == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None}}
    answer = b'{"id":"x","choices":[],"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1,2]}}'
    params = pd.kv_transfer_params(answer)
    decode = json.loads(pd.decode_body(body, params))
    assert decode["kv_transfer_params"] == {"do_remote_prefill": True, "remote_block_ids": [1, 2]}
    assert decode["max_tokens"] == 64 and decode["stream"] is True and "stream_options" in decode
    with pytest.raises(pd.PdBodyError, match="no kv_transfer_params"):
        pd.kv_transfer_params(b'{"choices":[]}')
    with pytest.raises(pd.PdBodyError, match="not a JSON object"):
        pd.prefill_body(b"[1]")
    assert isinstance(params, msgspec.Raw)


def test_the_sglang_body() -> None:
    body = b'{"model":"m","prompt":"hi","max_tokens":64,"stream":true}'
    both = json.loads(pd.sglang_body(body, pd.bootstrap_host("http://10.0.0.7:30000"), 8998, 2**63 - 1))
    assert both == {"model": "m", "prompt": "hi", "max_tokens": 64, "stream": True, "bootstrap_host": "10.0.0.7",
                    "bootstrap_port": 8998, "bootstrap_room": 2**63 - 1}
    assert pd.bootstrap_host("http://[::1]:8000") == "::1"
    with pytest.raises(pd.PdBodyError, match="not a JSON object"):
        pd.sglang_body(b"[1]", "h", 1, 0)


def test_the_prefill_pick_weighs_the_prefill_backlog_the_proxies_share() -> None:
    """One mechanism for both: the uncached prompt work waiting on each prefill node (this proxy's
    prefill legs not done, plus the other proxies' from the channel between proxies) referees the
    prefill pick; the decode pick, on its own role's weights and counts, does not read it."""
    from laswrr.schemas.peers import PeerState

    def picks(peer_backlog: dict[str, int]) -> tuple[Counter[str], Counter[str]]:
        router = Router("la-swrr", seed=1, proxy_id="b", share=True)
        router.table.offer(snap(1, view("p1", 1.0, NodeRole.PREFILL), view("p2", 1.0, NodeRole.PREFILL),
                          view("d1", 1.0, NodeRole.DECODE), view("d2", 1.0, NodeRole.DECODE)), now=0.0)
        if peer_backlog:
            assert router.channel.receive("a", DEFAULT_POOL, PeerState(boot_id="x", seq=1, ts_ns=1,
                                                backlog=peer_backlog), now=0.0)
        prefills, decodes = Counter[str](), Counter[str]()
        for i in range(8):
            raw = prompt_text(None, f"request {i}: " + "a distinct prompt " * 100)
            first = admit(router, DEFAULT_POOL, prompt=raw, size=request_size(raw, 8, None))
            second = admit(router, DEFAULT_POOL, role=NodeRole.DECODE)
            assert first is not None and second is not None
            prefills[first.node] += 1
            decodes[second.node] += 1
            router.admitter.release(first)
            router.admitter.release(second)
        return prefills, decodes

    alone, alone_decodes = picks({})
    assert alone == {"p1": 4, "p2": 4} and alone_decodes == {"d1": 4, "d2": 4}
    shared, shared_decodes = picks({"p1": 40_000})  # another proxy's prompts wait on p1
    assert shared == {"p2": 8} and shared_decodes == {"d1": 4, "d2": 4}


def _long_prompt_picks(router: Router, count: int) -> Counter[str]:
    """``count`` long prompts, each alone on an idle pool (released before the next)."""
    picks = Counter[str]()
    for k in range(count):
        seen = prompt_text(None, f"{router.table.scorer.sized} " + "x" * 32_000)  # no prefix shared with another
        first = admit(router, DEFAULT_POOL, prompt=seen, size=request_size(seen, 16, None))
        assert first is not None and first.role == NodeRole.PREFILL
        picks[first.node] += 1
        router.admitter.release(first)
    return picks


def _equal_prefill_pool(router: Router) -> None:
    router.table.offer(snap(1, view("p1", 4.0, NodeRole.PREFILL), view("p2", 4.0, NodeRole.PREFILL),
                      view("d1", 4.0, NodeRole.DECODE)), now=0.0)


def test_a_prefill_node_measured_at_half_speed_gets_no_long_prompt_while_the_fast_one_is_idle() -> None:
    router = Router("la-swrr", seed=1)
    _equal_prefill_pool(router)
    assert _long_prompt_picks(router, 10) == {"p1": 5, "p2": 5}  # unmeasured: the rotation, as without speeds
    for node, seconds in (("p1", 0.5), ("p2", 1.0)):  # 8,000 tokens each, p2 twice as long
        leg = admit(router, DEFAULT_POOL, tried=["p2" if node == "p1" else "p1"])
        assert leg is not None and leg.node == node
        leg.work = 8_000
        router.admitter.prefill_done(leg, seconds)
        router.admitter.release(leg)
    assert router.table.speeds.rate == {"p1": 16_000.0, "p2": 8_000.0}
    picks = _long_prompt_picks(router, 10)
    assert picks["p1"] >= 9  # idle p1 finishes first; p2 gets a probe once the drift brought it back
    # p1 busy with more work than the request: the slower p2 now finishes first
    busy = admit(router, DEFAULT_POOL, tried=["p2"], prompt=b"y" * 64_000, size=request_size(b"y" * 64_000, 16, None))
    assert busy is not None and busy.node == "p1"
    assert _long_prompt_picks(router, 1) == {"p2": 1}


def test_prefill_rates_come_from_legs_with_work_and_alike_nodes_keep_the_rotation() -> None:
    router = Router("la-swrr", seed=1)
    _equal_prefill_pool(router)
    leg = admit(router, DEFAULT_POOL)
    assert leg is not None
    leg.work = 100  # the round trip, not the rate
    router.admitter.prefill_done(leg, 0.01)
    assert router.table.speeds.rate == {}
    leg.work = 9_000
    router.admitter.prefill_done(leg, 1.0)
    router.admitter.prefill_done(leg, 0.5)  # the moving average: 9,000 + 0.3 x (18,000 - 9,000)
    assert router.table.speeds.rate == {leg.node: pytest.approx(11_700.0)}
    router.admitter.release(leg)
    other = "p2" if leg.node == "p1" else "p1"
    router.table.speeds.rate[other] = 10_000.0  # within PREFILL_SPEED_ALIKE of the fastest: alike
    assert _long_prompt_picks(router, 10) == {"p1": 5, "p2": 5}
    decode = admit(router, DEFAULT_POOL, role=NodeRole.DECODE)
    assert decode is not None
    router.admitter.prefill_done(decode, 1.0)  # a decode leg is no prefill measure
    assert "d1" not in router.table.speeds.rate


def test_a_pair_s_prefill_pick_answers_for_the_ttft_target_and_its_decode_pick_for_the_tpot() -> None:
    model = LatencyModel()
    router = Router("la-swrr", seed=1, scorer=None, latency=model)
    pd_pool(router)
    for i in range(20):  # p1 prefills 8,000 tokens/s, p2 2,000; d1 decodes at 20 ms a token, d2 at 200 ms
        work = 500 + 97 * i
        model.observe_prefill("p1", work, work / 8000)
        model.observe_prefill("p2", work, work / 2000)
        model.observe_decode("p1", 1, 2, 5.0)  # a prefill node's own decode time: no TPOT target reads it
        model.observe_decode("d1", 1 + i % 4, 50, 49 * 0.02)
        model.observe_decode("d2", 1 + i % 4, 50, 49 * 0.2)
    objective = Objective(ttft_ms=1000, tpot_ms=50)
    size = request_size(b"x" * 16000, 50, None)  # 4,000 tokens: 0.5 s on p1, 2 s on p2
    for _ in range(6):
        first = router.admitter.admit(AdmitRequest(DEFAULT_POOL, size=size, objective=objective))
        second = router.admitter.admit(AdmitRequest(DEFAULT_POOL, size=size, objective=objective, role=NodeRole.DECODE))
        assert isinstance(first, Admission) and isinstance(second, Admission)
        assert (first.node, second.node) == ("p1", "d1")
        router.admitter.release(first)
        router.admitter.release(second)
    slow = Objective(tpot_ms=10)  # no decode node decodes this fast: the decode pick is served as without
    second = router.admitter.admit(AdmitRequest(DEFAULT_POOL, size=size, objective=slow, role=NodeRole.DECODE))
    assert isinstance(second, Admission)
