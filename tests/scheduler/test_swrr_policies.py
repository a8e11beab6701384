"""SWRR and the pick policies: exact sequences, the Σcw = 0 invariant, shares, seeds.

Oracles (docs/algorithm.md §5): static integer weights give the nginx
sequence with period W = Σw and exact counts per period; Σ current weights is 0 after every
pick, whatever changes between picks; no node is ever a full pick ahead of its share.
"""

from __future__ import annotations

from collections import Counter, deque

from hypothesis import given, settings
from hypothesis import strategies as st

from laswrr.scheduler.policies import POLICIES, Candidate, PickContext, make_policy
from laswrr.scheduler.policies.la_swrr import LaSwrr
from laswrr.scheduler.rng import Rng
from laswrr.scheduler.swrr import Swrr

NGINX_517 = "aabacaa"  # nginx commit 52327e062: weights a=5, b=1, c=1


def _swrr(*weights: tuple[str, int]) -> Swrr:
    swrr = Swrr()
    swrr.set_weights(list(weights))
    return swrr


def _la(*candidates: tuple[str, int]) -> LaSwrr:
    policy = LaSwrr(Rng(0), warmup=False)
    policy.set_candidates([Candidate(n, w) for n, w in candidates])
    return policy


def _picks(pick, count: int) -> str:  # type: ignore[no-untyped-def]
    return "".join(pick() for _ in range(count))


def _cw_sum(policy: LaSwrr | Swrr) -> int:
    swrr = policy.swrr if isinstance(policy, LaSwrr) else policy
    return sum(swrr.current.values())


# -- plain SWRR: the nginx oracle ------------------------------------------------------------


def test_nginx_517_sequence_twice() -> None:
    swrr = _swrr(("a", 5), ("b", 1), ("c", 1))
    assert _picks(swrr.pick, 14) == NGINX_517 * 2


def test_nginx_517_state_returns_to_zero_after_one_period() -> None:
    swrr = _swrr(("a", 5), ("b", 1), ("c", 1))
    for _ in range(7):
        swrr.pick()
        assert sum(swrr.current.values()) == 0
    assert swrr.current == {"a": 0, "b": 0, "c": 0}


def test_equal_weights_are_round_robin_in_list_order() -> None:
    swrr = _swrr(("a", 3), ("b", 3), ("c", 3))
    assert _picks(swrr.pick, 6) == "abcabc"  # ties go to the earliest node, as in nginx


def test_zero_weight_and_excluded_nodes_are_never_picked() -> None:
    swrr = _swrr(("a", 5), ("b", 0), ("c", 1))
    picks = _picks(lambda: swrr.pick(exclude={"a"}), 12)
    assert picks == "c" * 12
    assert sum(swrr.current.values()) == 0


def test_nothing_eligible_gives_none_and_leaves_state_alone() -> None:
    swrr = _swrr(("a", 0), ("b", 2))
    before = dict(swrr.current)
    assert swrr.pick(exclude={"b"}) is None
    assert swrr.current == before


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=20), min_size=1, max_size=8))
def test_period_is_sum_of_weights_with_exact_counts(weights: list[int]) -> None:
    names = [f"n{i}" for i in range(len(weights))]
    swrr = _swrr(*zip(names, weights))
    total = sum(weights)
    counts: Counter[str] = Counter()
    for t in range(1, total + 1):
        counts[swrr.pick()] += 1
        assert sum(swrr.current.values()) == 0
        for name, weight in zip(names, weights):
            # nginx SWRR property: count_i(t) - t·w_i/W < 1 (never a full pick ahead of the share)
            assert counts[name] * total - t * weight < total
    assert counts == Counter(dict(zip(names, weights)))
    assert set(swrr.current.values()) == {0}


# -- Σcw = 0 under change ---------------------------------------------------------------------

_NODES = ["a", "b", "c", "d", "e"]
_set_op = st.tuples(st.just("set"), st.lists(st.tuples(st.sampled_from(_NODES), st.integers(0, 12_000)),
                                             max_size=5, unique_by=lambda t: t[0]))
_pick_op = st.tuples(st.just("pick"), st.tuples(st.frozensets(st.sampled_from(_NODES), max_size=3),
                                                st.dictionaries(st.sampled_from(_NODES), st.integers(0, 50))))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_set_op, _pick_op), max_size=60))
def test_la_swrr_sum_of_current_weights_stays_zero_under_any_change(ops: list) -> None:  # type: ignore[type-arg]
    policy = LaSwrr(Rng(7))
    weights: dict[str, int] = {}
    for op, arg in ops:
        if op == "set":
            policy.set_candidates([Candidate(n, w) for n, w in arg])
            weights = dict(arg)
        else:
            exclude, inflight = arg
            chosen = policy.pick(PickContext(inflight, exclude))
            eligible = {n for n, w in weights.items() if w > 0 and n not in exclude}
            if eligible:
                assert chosen in eligible
            else:
                assert chosen is None
        assert _cw_sum(policy) == 0, (op, arg, policy.swrr.current)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(_set_op, _pick_op), max_size=60))
def test_plain_swrr_sum_of_current_weights_stays_zero_under_any_change(ops: list) -> None:  # type: ignore[type-arg]
    swrr = Swrr()
    for op, arg in ops:
        if op == "set":
            swrr.set_weights(list(arg))
        else:
            swrr.pick(arg[0])
        assert sum(swrr.current.values()) == 0


def test_removed_node_credit_is_spread_and_new_node_starts_at_zero() -> None:
    swrr = _swrr(("a", 5), ("b", 1), ("c", 1))
    swrr.pick()
    swrr.pick()  # a a: a=-4, b=2, c=2
    assert swrr.current == {"a": -4, "b": 2, "c": 2}
    swrr.set_weights([("a", 5), ("b", 1), ("d", 3)])  # c leaves with +2, spread over a and b; d joins at 0
    assert swrr.current == {"a": -3, "b": 3, "d": 0}
    assert sum(swrr.current.values()) == 0


def test_node_going_to_weight_zero_is_recentred_and_returns_without_a_burst() -> None:
    # re-centring (docs/algorithm.md §5): an ineligible node must not keep credit and burst on its return.
    swrr = _swrr(("a", 1), ("b", 1), ("c", 1))
    swrr.set_weights([("a", 1), ("b", 1), ("c", 0)])
    for _ in range(50):
        swrr.pick()
    assert swrr.current["c"] == 0
    swrr.set_weights([("a", 1), ("b", 1), ("c", 1)])
    picks = _picks(swrr.pick, 6)
    assert sorted(picks) == sorted("aabbcc")


# -- LA-SWRR: SWRR refereed by live in-flight ---------------------------------------------------


def test_la_swrr_without_load_is_exactly_nginx() -> None:
    policy = _la(("a", 5000), ("b", 1000), ("c", 1000))
    assert _picks(lambda: policy.pick(PickContext({})), 21) == NGINX_517 * 3


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=20), min_size=1, max_size=8), st.integers(0, 30))
def test_la_swrr_with_equal_per_weight_inflight_reproduces_nginx(weights: list[int], per_weight: int) -> None:
    names = [f"n{i}" for i in range(len(weights))]
    inflight = {n: per_weight * w for n, w in zip(names, weights)}  # equal in-flight per unit of weight
    policy = _la(*zip(names, weights))
    swrr = _swrr(*zip(names, weights))
    total = sum(weights)
    assert _picks(lambda: policy.pick(PickContext(inflight)) + ",", 3 * total) == _picks(lambda: swrr.pick() + ",", 3 * total)


def test_la_swrr_moves_picks_off_a_loaded_node_and_keeps_the_sum() -> None:
    policy = _la(("a", 5000), ("b", 1000), ("c", 1000))
    inflight = {"a": 100, "b": 0, "c": 0}
    seq = ""
    for _ in range(14):
        seq += policy.pick(PickContext(inflight))
        assert _cw_sum(policy) == 0
    # a is SWRR's leader every pass but far busier per unit of weight: the lightest node gets it.
    # Pass 1: a5 b1 c1 -> b is charged 7; pass 2: a10 b-5 c2 -> c is charged 7 and a's 3 above
    # one round go to c; then b and c alternate with a parked at cw = 7 (one round).
    assert seq == "bcccbcbcbcbcbc"
    assert policy.swrr.current["a"] == 7000  # milli-units
    # a's credit is capped at one round (forfeit), so when it frees up it gets no burst beyond
    # nginx run: at most 5 in a row, and over 3 periods its share (15) plus the one pick that
    # one round of kept credit is worth.
    seq = _picks(lambda: policy.pick(PickContext({})), 21)
    assert "a" * 6 not in seq
    assert seq.count("a") == 16
    assert _cw_sum(policy) == 0


def test_la_swrr_leader_yields_to_a_lighter_node_anywhere_in_the_rotation() -> None:
    # Equal weights: SWRR's leader is a, its runner-up b; d, last in the rotation, is the one
    # with a request fewer in flight, and the one-request gap is enough (">=").
    policy = _la(("a", 1000), ("b", 1000), ("c", 1000), ("d", 1000))
    assert policy.pick(PickContext({"a": 1, "b": 1, "c": 1, "d": 0})) == "d"
    assert _cw_sum(policy) == 0


@settings(max_examples=150, deadline=None)
@given(st.integers(min_value=2, max_value=8), st.integers(min_value=1, max_value=20),
       st.lists(st.tuples(st.integers(0, 7), st.booleans()), min_size=1, max_size=80))
def test_la_swrr_with_equal_weights_always_picks_a_least_loaded_node(size: int, weight: int,
                                                                      steps: list) -> None:  # type: ignore[type-arg]
    """In a homogeneous pool the referee keeps in-flight as level as least-request does: every
    pick goes to a node with the fewest requests in flight, whatever finishes in between."""
    names = [f"n{i}" for i in range(size)]
    policy = _la(*((n, weight * 1000) for n in names))
    inflight = Counter({n: 0 for n in names})
    for index, finish in steps:
        node = names[index % size]
        if finish and inflight[node]:
            inflight[node] -= 1
        chosen = policy.pick(PickContext(inflight))
        assert chosen is not None and inflight[chosen] == min(inflight.values()), (chosen, inflight)
        inflight[chosen] += 1


def test_la_swrr_referee_does_not_undo_weights_at_low_concurrency() -> None:
    # One request in flight on the heavy leader (1/5 per weight) vs none on a light node:
    # sending the next request to b would leave b at 1/1 per weight, worse than a. SWRR stands.
    policy = _la(("a", 5000), ("b", 1000))
    assert policy.pick(PickContext({"a": 1, "b": 0})) == "a"
    # ... but a leader that is worse off than the runner-up would be after taking it yields.
    policy = _la(("a", 5000), ("b", 1000))
    assert policy.pick(PickContext({"a": 6, "b": 0})) == "b"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=20), min_size=2, max_size=8),
       st.integers(min_value=1, max_value=60), st.integers(min_value=0, max_value=2**32))
def test_la_swrr_long_run_shares_match_weights_in_a_closed_loop(weights: list[int], duration: int,
                                                                 seed: int) -> None:
    """Every request lasts ``duration`` picks (equal service per request, so a node's fair
    in-flight is proportional to its weight). Stated tolerance: each node's share over 100
    periods within 1 percentage point of w_i / W, at any concurrency (1..60 in flight)."""
    names = [f"n{i}" for i in range(len(weights))]
    policy = make_policy("la-swrr", seed)
    policy.set_candidates([Candidate(n, w * 1000) for n, w in zip(names, weights)])
    inflight: Counter[str] = Counter()
    running: deque[str] = deque()
    counts: Counter[str] = Counter()
    total = sum(weights)
    picks = 100 * total
    for _ in range(picks):
        node = policy.pick(PickContext(inflight))
        assert node is not None
        counts[node] += 1
        inflight[node] += 1
        running.append(node)
        if len(running) > duration:
            inflight[running.popleft()] -= 1
    for name, weight in zip(names, weights):
        assert abs(counts[name] / picks - weight / total) <= 0.01, (name, counts, weights)


def test_la_swrr_warmup_is_a_seeded_rotation_of_the_nginx_sequence() -> None:
    doubled = NGINX_517 * 2
    starts = set()
    for seed in range(20):
        policy = make_policy("la-swrr", seed)
        policy.set_candidates([Candidate("a", 5000), Candidate("b", 1000), Candidate("c", 1000)])
        seq = _picks(lambda: policy.pick(PickContext({})), 7)  # noqa: B023
        assert seq in doubled
        starts.add(doubled.index(seq))
        again = make_policy("la-swrr", seed)
        again.set_candidates([Candidate("a", 5000), Candidate("b", 1000), Candidate("c", 1000)])
        assert _picks(lambda: again.pick(PickContext({})), 7) == seq  # noqa: B023
    assert len(starts) > 1  # replicas with different seeds do not start in lockstep


# -- the other policies -----------------------------------------------------------------------

_FOUR = [Candidate("a", 4000), Candidate("b", 1000), Candidate("c", 1000), Candidate("d", 1000)]


def _run(name: str, seed: int, count: int, inflight: dict[str, int] | None = None,
         exclude: frozenset[str] = frozenset(), candidates: list[Candidate] = _FOUR) -> list[str | None]:
    policy = make_policy(name, seed)
    policy.set_candidates(candidates)
    return [policy.pick(PickContext(inflight or {}, exclude)) for _ in range(count)]


def test_every_policy_is_reproducible_from_its_seed() -> None:
    load = {"a": 3, "b": 1, "c": 0, "d": 2}
    for name in POLICIES:
        assert _run(name, 42, 200, load) == _run(name, 42, 200, load)


def test_round_robin_ignores_weights_and_cycles() -> None:
    picks = _run("rr", 3, 12)
    cycle = picks[:4]
    assert sorted(cycle) == ["a", "b", "c", "d"]
    assert picks == cycle * 3
    offsets = {tuple(_run("rr", seed, 4)) for seed in range(16)}
    assert len(offsets) > 1  # the seed picks the starting offset


def test_least_request_picks_the_least_loaded_and_spreads_ties() -> None:
    assert set(_run("least-request", 1, 50, {"a": 5, "b": 2, "c": 1, "d": 3})) == {"c"}
    tied = Counter(_run("least-request", 1, 4000, {"a": 5, "b": 1, "c": 1, "d": 1}))
    assert set(tied) == {"b", "c", "d"}
    assert all(1200 <= tied[n] <= 1467 for n in "bcd"), tied  # uniform over the tie, ±10 %


def test_p2c_never_picks_the_unique_most_loaded_node() -> None:
    picks = Counter(_run("p2c", 5, 2000, {"a": 9, "b": 1, "c": 2, "d": 3}))
    assert "a" not in picks
    # the least loaded wins whenever it is drawn, i.e. in 1 - C(3,2)/C(4,2) = 1/2 of the draws
    assert 900 <= picks["b"] <= 1100, picks


def test_p2c_with_equal_load_is_uniform_within_one_point() -> None:
    picks = Counter(_run("p2c", 11, 100_000))
    assert all(abs(picks[n] / 100_000 - 0.25) <= 0.01 for n in "abcd"), picks


def test_p2c_draws_two_distinct_nodes() -> None:
    # With two nodes, distinct draws always compare both: the lighter one always wins.
    two = [Candidate("a", 1000), Candidate("b", 1000)]
    assert set(_run("p2c", 9, 200, {"a": 1, "b": 0}, candidates=two)) == {"b"}


def test_no_policy_picks_excluded_or_zero_weight_nodes() -> None:
    candidates = [Candidate("a", 1000), Candidate("z", 0), Candidate("b", 2000), Candidate("x", 1000)]
    for name in POLICIES:
        picks = set(_run(name, 1, 300, {"a": 2, "b": 5}, frozenset({"x"}), candidates))
        assert picks <= {"a", "b"}, (name, picks)
        assert _run(name, 1, 1, {}, frozenset({"a", "b", "x"}), candidates) == [None]
        assert _run(name, 1, 1, {}, frozenset(), []) == [None]


def test_candidate_from_weight_is_milli_units_and_never_negative() -> None:
    assert Candidate.from_weight("n", 9.1) == Candidate("n", 9100)
    assert Candidate.from_weight("n", 0.0005).weight in (0, 1)
    assert Candidate.from_weight("n", -3.0) == Candidate("n", 0)


def test_unknown_policy_name_is_a_clear_error() -> None:
    try:
        make_policy("fastest")
    except ValueError as exc:
        assert "la-swrr" in str(exc) and "fastest" in str(exc)
    else:
        raise AssertionError("expected ValueError")
