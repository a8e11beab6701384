"""Prefix affinity, pure: the index's keys, memory bound and eviction, the match, and the guard
inside LA-SWRR's pick (exact sequences; adversarial prefix sets by hypothesis)."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from laswrr.scheduler.policies import Candidate, PickContext
from laswrr.scheduler.policies.affinity import Affinity, PrefixIndex, guard_allows, prefix_keys
from laswrr.scheduler.policies.la_swrr import LaSwrr
from laswrr.scheduler.rng import Rng


def text(*blocks: str, size: int = 512) -> bytes:
    return b"".join(b.encode() * size for b in blocks)


def test_keys_are_a_prefix_chain_of_full_blocks() -> None:
    abc, abd = prefix_keys(text("a", "b", "c")), prefix_keys(text("a", "b", "d"))
    assert len(abc) == 3 and abc[:2] == abd[:2] and abc[2] != abd[2]
    assert prefix_keys(text("a") + b"tail") == abc[:1]
    assert prefix_keys(text("b", "b"))[1] != abc[1]
    assert prefix_keys(text(*"abcdef"), max_blocks=2) == prefix_keys(text("a", "b"))


def test_depth_and_preference() -> None:
    index = PrefixIndex()
    index.record("n1", prefix_keys(text("s", "a", "b")))
    index.record("n2", prefix_keys(text("s", "c")))
    keys = prefix_keys(text("s", "a", "x"))
    assert index.depths(keys, ["n1", "n2", "n3"]) == {"n1": 2, "n2": 1, "n3": 0}
    assert index.preferred(keys, ["n1", "n2", "n3"]) == ["n1", "n2"]
    assert index.preferred(keys, ["n1", "n2"]) == ["n1"]  # n2 holds only what every node holds
    assert index.preferred(prefix_keys(text("s", "q")), ["n1", "n2"]) == []  # everyone has "s": no preference
    assert index.preferred(prefix_keys(text("z")), ["n1", "n2"]) == []


def test_ties_go_by_rendezvous_the_same_in_every_replica() -> None:
    keys = prefix_keys(text("s", "t"))
    orders = set()
    for order in (["n1", "n2", "n3"], ["n3", "n1", "n2"]):
        index = PrefixIndex()
        for n in order:
            index.record(n, keys)
        orders.add(tuple(index.preferred(keys, order + ["n4"])))
    assert len(orders) == 1 and set(next(iter(orders))) == {"n1", "n2", "n3"}


def test_memory_bound_and_lru_eviction() -> None:
    index = PrefixIndex(blocks_per_node=6)
    prompts = [text(f"{i:x}"[-1], "q", "r") for i in range(10)]  # 3 blocks each
    for p in prompts:
        index.record("n1", prefix_keys(p))
    assert index.entries() == 6 and sum(len(h) for h in index.holders.values()) == 6
    assert index.depths(prefix_keys(prompts[-1]), ["n1"]) == {"n1": 3}
    assert index.depths(prefix_keys(prompts[-2]), ["n1"]) == {"n1": 3}
    assert index.depths(prefix_keys(prompts[-3]), ["n1"]) == {"n1": 0}
    # a re-sent prompt's leading block is refreshed last, so its tail goes before its head
    index = PrefixIndex(blocks_per_node=4)
    index.record("n1", prefix_keys(text("a", "b", "c")))
    index.record("n1", prefix_keys(text("x")))
    index.record("n1", prefix_keys(text("y")))
    assert index.depths(prefix_keys(text("a", "b", "c")), ["n1"]) == {"n1": 2}


def test_drop_forgets_a_node() -> None:
    index = PrefixIndex()
    keys = prefix_keys(text("a", "b"))
    index.record("n1", keys)
    index.record("n2", keys)
    index.drop("n1")
    assert index.nodes() == ["n2"] and all(h == {"n2"} for h in index.holders.values())
    index.drop("n2")
    assert index.holders == {} and index.entries() == 0


def test_a_full_index_costs_at_most_200_bytes_a_key() -> None:
    """At its cap the index holds blocks_per_node keys for every node; a key one node holds (the
    common case) shares that node's frozenset instead of a set of its own (216 bytes more)."""
    import random
    import tracemalloc

    rng = random.Random(7)
    chains = [[rng.getrandbits(64) for _ in range(64)] for _ in range(5 * 64)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex(blocks_per_node=4096)
        for n, keys in enumerate(chains):
            index.record(f"node-{n % 5}", keys)
        per_key = (tracemalloc.get_traced_memory()[0] - before) / index.entries()
    finally:
        tracemalloc.stop()
    assert index.entries() == 5 * 4096
    assert per_key < 200, per_key
    # shared keys still get sets of their own, and unholding one node leaves the other
    index.record("node-0", chains[1])
    assert index.holders[chains[1][0]] == {"node-0", "node-1"}
    index.drop("node-1")
    assert index.holders[chains[1][0]] == {"node-0"} and index.depths(chains[1], ["node-1"]) == {"node-1": 0}


def test_guard_arithmetic() -> None:
    # A has 1000 tokens in flight (weight 1), C none (weight 1); a 600-token request:
    assert not guard_allows(1000, 1, 0, 1, 600)  # 1000 >= 600: C after the pick is still lighter
    assert guard_allows(500, 1, 0, 1, 600)  # A stays within one request of the lightest
    assert guard_allows(1000, 2, 0, 1, 600)  # twice the weight, twice the room: 1000 < 1200


def policy(weights: dict[str, int]) -> LaSwrr:
    p = LaSwrr(Rng(0), warmup=False)
    p.set_candidates([Candidate(n, w) for n, w in weights.items()])
    return p


def test_affinity_pick_under_the_guard_and_its_charge() -> None:
    p = policy({"a": 1000, "b": 1000, "c": 1000})
    tokens = {"a": 0, "b": 0, "c": 0}
    plain = copy.deepcopy(p)
    assert plain.pick(PickContext({})) == "a"  # SWRR would start with a
    assert p.pick(PickContext({}, affinity=Affinity(["c"], tokens, 100))) == "c"
    assert sum(p.swrr.cw) == 0 and p.swrr.cw[2] == 1000 - 3000  # c charged the round
    # c now carries 100 tokens: a 100-token request still fits (100 < 0 + 100 is false: not allowed)
    assert p.pick(PickContext({"c": 1}, affinity=Affinity(["c"], {"c": 100}, 100))) != "c"


def test_without_preference_the_pick_is_exactly_la_swrr() -> None:
    a, b = policy({"a": 5000, "b": 1000, "c": 1000}), policy({"a": 5000, "b": 1000, "c": 1000})
    seq_a = [a.pick(PickContext({})) for _ in range(7)]
    seq_b = [b.pick(PickContext({}, affinity=Affinity([], {}, 10))) for _ in range(7)]
    assert seq_a == seq_b == list("aabacaa")


@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.integers(1, 20), min_size=2, max_size=8),
       sizes=st.lists(st.integers(1, 4000), min_size=50, max_size=300),
       prefixes=st.integers(1, 3), keep=st.integers(1, 24), seed=st.integers(0, 2**32))
def test_adversarial_prefixes_still_spread_and_never_pass_the_guard(weights: list[int], sizes: list[int],
                                                                   prefixes: int, keep: int, seed: int) -> None:
    """Every prompt shares one of a few long prefixes (the worst case for affinity): whenever
    the affinity changed LA-SWRR's pick, the node was within the guard before taking the request,
    and no node ever gets more than one request per unit of weight ahead of the lightest."""
    nodes = {f"n{i}": w * 1000 for i, w in enumerate(weights)}
    p = LaSwrr(Rng(seed))
    p.set_candidates([Candidate(n, w) for n, w in nodes.items()])
    index = PrefixIndex()
    prompts = [prefix_keys(text("s", f"{k}", "long", "prefix")) for k in range(prefixes)]
    inflight: dict[str, int] = {}
    tokens: dict[str, int] = {}
    open_requests: list[tuple[str, int]] = []
    biggest = max(sizes)
    for step, size in enumerate(sizes):
        keys = prompts[step % prefixes]
        preferred = index.preferred(keys, list(nodes))
        plain = copy.deepcopy(p).pick(PickContext(inflight))
        chosen = p.pick(PickContext(inflight, affinity=Affinity(preferred, tokens, size)))
        assert chosen is not None and plain is not None
        if chosen != plain:
            lightest = min(nodes, key=lambda n: ((tokens.get(n, 0) + size) / nodes[n], list(nodes).index(n)))
            assert guard_allows(tokens.get(chosen, 0), nodes[chosen], tokens.get(lightest, 0), nodes[lightest], size)
            per_weight = {n: tokens.get(n, 0) / nodes[n] for n in nodes}
            assert per_weight[chosen] < min(per_weight.values()) + biggest / min(nodes.values())
        index.record(chosen, keys)
        inflight[chosen] = inflight.get(chosen, 0) + 1
        tokens[chosen] = tokens.get(chosen, 0) + size
        open_requests.append((chosen, size))
        while len(open_requests) > keep:  # the oldest request finishes
            done, done_size = open_requests.pop(0)
            inflight[done] -= 1
            tokens[done] -= done_size
        assert sum(p.swrr.cw) == 0


def test_one_shared_prefix_spreads_over_the_pool() -> None:
    """All prompts identical and long, 12 in flight over 4 equal nodes: no hot spot."""
    nodes = {f"n{i}": 1000 for i in range(4)}
    p = policy(nodes)
    index = PrefixIndex()
    keys = prefix_keys(text(*"abcdefgh"))
    counts = dict.fromkeys(nodes, 0)
    inflight: dict[str, int] = {}
    tokens: dict[str, int] = {}
    window: list[str] = []
    for _ in range(400):
        node = p.pick(PickContext(inflight, affinity=Affinity(index.preferred(keys, list(nodes)), tokens, 1000)))
        assert node is not None
        index.record(node, keys)
        counts[node] += 1
        inflight[node] = inflight.get(node, 0) + 1
        tokens[node] = tokens.get(node, 0) + 1000
        window.append(node)
        if len(window) > 12:
            old = window.pop(0)
            inflight[old] -= 1
            tokens[old] -= 1000
        assert max(tokens.values()) - min(tokens.get(n, 0) for n in nodes) <= 2000
    assert min(counts.values()) >= 90, counts


def test_the_worked_example_of_the_algorithm_doc() -> None:
    """docs/algorithm.md §5a: a (weight 2) holds the prefix, b (weight 1) is idle, M = 1000."""
    costs = {"a": 952 + 1000}
    for running, by_work, by_guard in ((2, "a", "a"), (4, "a", "a"), (6, "b", "a"), (7, "b", "b")):
        load = {"a": 1000 + running * 1000, "b": 0}
        for lead in ("a", "b"):
            referee = by_work if lead == "a" else "b"  # an idle leader keeps the request
            p = policy({"a": 2000, "b": 1000})
            if lead == "b":
                p.swrr.cw[:] = [-1000, 1000]  # b leads the next SWRR step
            plain = copy.deepcopy(p)
            assert plain.pick(PickContext({}, affinity=Affinity([], load, 4000, costs))) == referee, (running, lead)
            assert p.pick(PickContext({}, affinity=Affinity(["a"], load, 4000, costs))) == by_guard, (running, lead)
