"""The exact cache view in the pick (scheduler/routing/work.py, "The exact view"): the nodes whose
engines publish KV events count the prompt tokens their engine holds, the others keep the
estimated view, and the admission carries what the view predicted on the node picked."""

from __future__ import annotations

from laswrr.scheduler.routing.prompt import RequestSize, prompt_text, request_size
from laswrr.scheduler.routing.router import DEFAULT_POOL, AdmitRequest, Admission, Router
from laswrr.schemas.kvcache import CacheChanged, chain_keys, pack_block_keys
from laswrr.schemas.outputs import LoadView, NodeView, WeightSnapshot

LOAD = LoadView(queue=0, running=0, kv=0, npu=0, latency=0, load=0, sample_age_ms=None, stale=False)
BLOCK = 128
TOKENS = list(range(7, 7 + 300))  # two whole blocks and a partial one
TEXT = prompt_text([{"role": "user", "content": "x" * 2048}], None)  # four 512-character blocks in the estimate


def node(name: str) -> NodeView:
    return NodeView(node=name, url=f"http://{name}:8000", phase="active", routable=True, capacity=4,
                    target_weight=1000, effective_weight=1000, inflight=0, chip="910B", health=1.0, load=LOAD)


def router() -> Router:
    r = Router("la-swrr", seed=0)
    r.table.offer(WeightSnapshot(pool=DEFAULT_POOL, as_of_seq=1, tick=1, ts_ns=0, panic=False,
                                 nodes=[node("a"), node("b"), node("c")]), 0.0)
    return r


def holds(r: Router, name: str, tokens: list[int]) -> None:
    """``name``'s engine says (a cleared change: a fresh view) it holds the whole blocks of ``tokens``."""
    keys = pack_block_keys(chain_keys(tokens, BLOCK))
    assert r.table.kv.apply(name, CacheChanged(n=1, seq=0, block_size=BLOCK, stored=keys, cleared=True, reason="cleared"))


def admit(r: Router, tokens: list[int] | None) -> Admission:
    size = request_size(TEXT, 8, None) if tokens is None else RequestSize(len(tokens), 8)
    result = r.admitter.admit(AdmitRequest(DEFAULT_POOL, (), TEXT, size, tokens=tokens))
    assert isinstance(result, Admission)
    r.admitter.release(result)
    return result


def test_the_engine_s_view_overrides_a_belief_in_an_evicted_prefix() -> None:
    r = router()
    first = admit(r, None)  # the estimated view now believes `first.node` holds the prompt
    assert admit(r, None).node == first.node and first.cached is None  # no tokens: no prediction recorded
    other = next(n for n in "abc" if n != first.node)
    holds(r, other, TOKENS)
    for name in "abc":
        if name != other:
            holds(r, name, [])  # exact and empty: the prefix was evicted there
    exact = admit(r, TOKENS)
    assert exact.node == other and exact.cached == 2 * BLOCK
    assert admit(r, None).node == first.node  # a request without tokens: the estimated view alone


def test_a_node_without_events_keeps_its_estimate_in_a_mixed_pool() -> None:
    r = router()
    first = admit(r, None)
    other = next(n for n in "abc" if n != first.node)
    holds(r, other, TOKENS[:BLOCK])  # one block by its events; `first.node` publishes none: 4 estimated blocks
    picked = admit(r, TOKENS)
    assert picked.node == first.node and picked.cached == len(TOKENS)  # the estimate caps at the prompt
    third = next(n for n in "abc" if n not in (first.node, other))
    holds(r, third, [])
    r.table.kv.drop(other)  # its events stopped: back to the estimate, where it holds nothing
    assert admit(r, TOKENS).node == first.node


def test_the_exact_order_is_by_tokens_held_and_costs_follow() -> None:
    r = router()
    holds(r, "a", TOKENS[:BLOCK])
    holds(r, "b", TOKENS)
    holds(r, "c", [])
    picked = admit(r, TOKENS)
    assert (picked.node, picked.cached, picked.backlog) == ("b", 256, 0)  # backlog 0 once prefilled (released)
    result = r.admitter.admit(AdmitRequest(DEFAULT_POOL, ("b",), TEXT, RequestSize(len(TOKENS), 8), tokens=TOKENS))
    assert isinstance(result, Admission) and (result.node, result.cached, result.backlog) == ("a", 128, 300 - 128)


def test_a_prompt_of_whole_blocks_is_never_all_cached() -> None:
    """vLLM computes a prompt's last token again (its logits): a block ending at it is not a hit."""
    r = router()
    whole = TOKENS[:2 * BLOCK]
    holds(r, "a", whole)
    assert r.table.kv.cached(whole, ["a"]) == {"a": BLOCK}
    assert r.table.kv.cached(whole + [1], ["a"]) == {"a": 2 * BLOCK}


def test_a_stale_node_falls_back_and_a_pool_without_events_is_untouched() -> None:
    r = router()
    holds(r, "b", TOKENS)
    assert not r.table.kv.apply("b", CacheChanged(n=3, seq=2, block_size=BLOCK))  # n=2 was lost
    assert not r.table.kv.exact("b")
    plain, exact = router(), router()
    holds(exact, "zz", TOKENS)  # a node of no pool: nothing changes for this pool's nodes
    picks = [(admit(plain, TOKENS).node, admit(plain, None).node) for _ in range(6)]
    assert picks == [(admit(exact, TOKENS).node, admit(exact, None).node) for _ in range(6)]


def test_a_pick_of_a_node_held_exactly_sends_no_prefix_record_to_the_peers() -> None:
    r = Router("la-swrr", seed=0, proxy_id="A", share=True)
    r.table.offer(WeightSnapshot(pool=DEFAULT_POOL, as_of_seq=1, tick=1, ts_ns=0, panic=False,
                                 nodes=[node("a"), node("b"), node("c")]), 0.0)
    for name in "bc":
        holds(r, name, [])  # b and c publish events; a does not
    route = r.table.route(DEFAULT_POOL)
    assert route is not None
    told: dict[str, int] = {}
    for k in range(12):  # distinct prompts, so that every pick is a new prefix
        text = prompt_text([{"role": "user", "content": f"conversation {k} " * 200}], None)
        result = r.admitter.admit(AdmitRequest(DEFAULT_POOL, (), text, request_size(text, 8, None)))
        assert isinstance(result, Admission)
        r.admitter.release(result)
        told[result.node] = told.get(result.node, 0) + 1
    records = {record.node for record in route.outbox}
    assert set(told) == {"a", "b", "c"}  # every node was picked ...
    assert records == {"a"}  # ... but only the node without events is told on the channel
