"""Prefix affinity in the proxy's routing table (pure): exact LA-SWRR without shared prefixes,
conversations kept on their node while the guard allows, ejected and removed nodes forgotten,
and what the proxy reads from a body."""

from __future__ import annotations

import msgspec

from laswrr.scheduler.routing.prompt import RequestSize, prompt_text, request_size
from tests.scheduler.routing_help import admit
from laswrr.scheduler.routing.router import Router
from tests.proxy.test_proxy_routing import node, snap


def turn(conversation: int, turns: int) -> bytes:
    """A chat prompt growing turn by turn (each turn adds 600 characters)."""
    return b"".join(f"conversation {conversation} turn {t} ".encode() * 20 for t in range(turns))


def picks_of(router: Router, sized: bool) -> list[str]:
    """60 unshared 2000-character prompts, one of every three released after the next two."""
    picks, held = [], []
    for i in range(60):
        admission = admit(router, "default", prompt=f"request {i} ".encode() * 200,
                                 size=RequestSize(500) if sized else None)
        assert admission is not None
        picks.append(admission.node)
        held.append(admission)
        if i % 3 == 2:
            router.admitter.release(held.pop(0))
    return picks


def test_unsized_requests_pick_exactly_as_la_swrr() -> None:
    on, off = Router("la-swrr", seed=7), Router("la-swrr", seed=7, scorer=None)
    for router in (on, off):
        router.table.offer(snap(1, node("a", 5), node("b", 1), node("c", 1)), now=0)
    assert picks_of(on, sized=False) == picks_of(off, sized=False)
    assert off.table.route("default").index is None and on.table.route("default").index is not None


def test_equal_unshared_requests_on_equal_weights_pick_exactly_as_la_swrr() -> None:
    """Equal costs, no backlog leaving: the work referee is the request referee in other units."""
    on, off = Router("la-swrr", seed=7), Router("la-swrr", seed=7, scorer=None)
    for router in (on, off):
        router.table.offer(snap(1, node("a", 3), node("b", 3), node("c", 3)), now=0)
    assert picks_of(on, sized=True) == picks_of(off, sized=True)


def test_the_work_referee_sends_a_request_past_a_prefill_backlog() -> None:
    """a and b each run one request; a's is still in prefill (a 20k-token prompt), b's has sent its
    first byte. Counting requests they are level; counting work, b is lighter and takes the next."""
    for leader_first in (True, False):
        router = Router("la-swrr", seed=3)
        router.table.offer(snap(1, node("a", 4), node("b", 4)), now=0)
        first = admit(router, "default", prompt=b"p" * 80_000, size=RequestSize(20_000))
        second = admit(router, "default", prompt=b"q" * 2_000, size=RequestSize(500))
        assert first is not None and second is not None and first.node != second.node
        router.admitter.prefilled(second)
        assert router.table.load.backlog == {first.node: 20_000}
        if not leader_first:  # the SWRR leader now is the other node: the referee must still move it
            router.table.route("default").first.policy.swrr.cw.reverse()
        third = admit(router, "default", prompt=b"r" * 2_000, size=RequestSize(500))
        assert third is not None and third.node == second.node
        router.admitter.release(first)
        assert first.node not in router.table.load.backlog


def sized(prompt: bytes) -> RequestSize:
    return request_size(prompt, None, None)


def test_a_conversation_stays_on_its_node_while_the_guard_allows() -> None:
    router = Router("la-swrr", seed=1)
    router.table.offer(snap(1, node("a", 4), node("b", 4), node("c", 4)), now=0)
    first = admit(router, "default", prompt=turn(1, 2), size=sized(turn(1, 2)))
    assert first is not None
    router.admitter.release(first)
    for turns in range(3, 9):
        admission = admit(router, "default", prompt=turn(1, turns), size=sized(turn(1, turns)))
        assert admission is not None and admission.node == first.node
        router.admitter.release(admission)
    # the same turn sent again and again with nothing finishing: its node takes the first ones,
    # then the guard spreads them (the cached prefix makes it cheaper, not unbounded)
    busy = [admit(router, "default", prompt=turn(1, 8), size=sized(turn(1, 8))) for _ in range(6)]
    nodes = [b.node for b in busy if b is not None]
    assert len(nodes) == 6 and nodes[0] == first.node
    assert 2 <= nodes.count(first.node) <= 4 and len(set(nodes)) == 3, nodes


def test_ejected_and_removed_nodes_are_dropped_from_the_index() -> None:
    router = Router("la-swrr", seed=1)
    router.table.offer(snap(1, node("a", 4), node("b", 4)), now=0)
    for i in range(4):
        admission = admit(router, "default", prompt=turn(i, 3), size=RequestSize(10))
        assert admission is not None
        router.admitter.release(admission)
    index = router.table.route("default").index
    assert index is not None and sorted(index.nodes()) == ["a", "b"]
    ejected = msgspec.structs.replace(node("a", 0, routable=False), phase="ejected")
    router.table.offer(snap(2, ejected, node("b", 4)), now=1)
    assert index.nodes() == ["b"]
    router.table.offer(snap(3, node("b", 4, routable=False)), now=2)  # draining: its cache is still there
    assert index.nodes() == ["b"]
    router.table.offer(snap(4, node("c", 4)), now=3)  # b removed
    assert index.nodes() == []


def test_other_policies_have_no_affinity() -> None:
    router = Router("p2c", seed=1)
    router.table.offer(snap(1, node("a", 4), node("b", 4)), now=0)
    assert router.table.route("default").index is None and router.affinity_mode == "none"
    assert admit(router, "default", prompt=b"z" * 4096, size=RequestSize(10)) is not None


def test_prompt_text_and_tokens_of_bodies() -> None:
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert prompt_text(chat, None) == b"system\nbe brief\nuser\nhi\n"
    assert prompt_text(None, "once upon") == b"once upon" and prompt_text(None, ["x"]) == b"x"
    assert prompt_text(None, [1, 2, 3]) == b"" and prompt_text("bad", None) == b""
    assert prompt_text([{"role": "user", "content": None}, 5], None) == b"user\n\n"
    assert request_size(b"a" * 400, 50, None) == RequestSize(100, 50)
    assert request_size(b"a" * 400, 50, 20) == RequestSize(100, 20)
    assert request_size(b"a" * 400, True, None) == RequestSize(100)
    assert request_size(b"", "x", -1) == RequestSize(0, None)
