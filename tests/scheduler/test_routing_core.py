"""The pure routing core (scheduler/routing): one pick call for every policy, the admission's
refusals, and a Router driven twice by the same inputs making the same decisions."""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from laswrr.scheduler.policies import POLICIES, Candidate, PickContext, make_policy
from tests.scheduler.routing_help import admit
from laswrr.scheduler.policies.affinity import Affinity
from laswrr.scheduler.routing.prompt import prompt_text, request_size
from laswrr.scheduler.routing.router import DEFAULT_POOL, AdmitRequest, Admission, Refusal, Router
from laswrr.schemas.words import RefusalCause
from laswrr.schemas.outputs import LoadView, NodeView, WeightSnapshot

ROOT = Path(__file__).resolve().parents[2]
LOAD = LoadView(queue=0, running=0, kv=0, npu=0, latency=0, load=0, sample_age_ms=None, stale=False)
CANDIDATES = [Candidate("a", 5000), Candidate("b", 1000), Candidate("c", 1000), Candidate("d", 2000)]


def node(name: str, weight: float, capacity: int = 4, routable: bool = True) -> NodeView:
    return NodeView(node=name, url=f"http://{name}:8000", phase="active" if routable else "draining",
                    routable=routable, capacity=capacity, target_weight=weight, effective_weight=weight,
                    inflight=0, chip="910B", health=1.0, load=LOAD)


def snap(seq: int, *nodes: NodeView) -> WeightSnapshot:
    return WeightSnapshot(pool=DEFAULT_POOL, as_of_seq=seq, tick=seq, ts_ns=0, panic=False, nodes=list(nodes))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_takes_the_one_context_and_honours_exclusions(name: str) -> None:
    policy = make_policy(name, seed=3)
    policy.set_candidates(CANDIDATES)
    inflight = {"a": 2, "b": 1}
    affinity = Affinity(["c"], {"c": 10}, 100)
    for _ in range(40):
        assert policy.pick(PickContext(inflight, {"a", "d"}, affinity)) in {"b", "c"}
    assert policy.pick(PickContext(inflight, {"a", "b", "c", "d"}, affinity)) is None
    assert policy.pick(PickContext()) in {"a", "b", "c", "d"}  # every field has a default


@pytest.mark.parametrize("name", sorted(n for n, cls in POLICIES.items() if not cls.uses_affinity))
def test_a_policy_that_does_not_use_affinity_ignores_it(name: str) -> None:
    with_it = make_policy(name, seed=7)
    with_it.set_candidates(CANDIDATES)
    without = copy.deepcopy(with_it)
    inflight = {"a": 3, "c": 1}
    affinity = Affinity(["b"], {"b": 0}, 1, {"b": 1})
    picks = [with_it.pick(PickContext(inflight, {"d"}, affinity)) for _ in range(30)]
    assert picks == [without.pick(PickContext(inflight, {"d"})) for _ in range(30)]


def test_the_router_keeps_a_prefix_index_only_for_a_policy_that_uses_affinity() -> None:
    assert [n for n, cls in POLICIES.items() if cls.uses_affinity] == ["la-swrr"]
    for name, cls in POLICIES.items():
        router = Router(name, seed=0)
        router.table.offer(snap(1, node("a", 1)), now=0)
        assert router.affinity_mode == ("prefix" if cls.uses_affinity else "none")
        assert (router.table.route(DEFAULT_POOL).index is not None) == cls.uses_affinity
    assert Router("la-swrr", seed=0, scorer=None).affinity_mode == "none"


def why(router: Router, pool: str, tried: tuple[str, ...] = ()) -> Refusal:
    result = router.admitter.admit(AdmitRequest(pool, tried))
    assert isinstance(result, Refusal)
    return result


def test_refusal_tells_a_saturated_pool_from_one_with_no_routable_node() -> None:
    router = Router("least-request", seed=0, inflight_cap_per_capacity=0.5)  # caps: a ceil(1.5) = 2, b 1
    assert why(router, "nowhere") == Refusal(RefusalCause.NO_SNAPSHOT)
    router.table.offer(snap(1, node("a", 1, capacity=3), node("b", 1, capacity=1), node("c", 1, routable=False)), now=0)
    held = [admit(router, DEFAULT_POOL) for _ in range(3)]
    assert all(held)
    assert why(router, DEFAULT_POOL) == Refusal(RefusalCause.NO_ROUTABLE_NODE, saturated=True)
    assert why(router, DEFAULT_POOL, ("a",)).saturated  # b untried, at its cap
    assert why(router, DEFAULT_POOL, ("a", "b")) == Refusal(RefusalCause.NO_ROUTABLE_NODE)  # c is not routable
    first = held[0]
    assert isinstance(first, Admission)
    router.admitter.release(first)
    assert admit(router, DEFAULT_POOL) is not None  # a slot came free: the same call admits again

    uncapped = Router("rr", seed=0)
    uncapped.table.offer(snap(1, node("a", 1)), now=0)
    assert not why(uncapped, DEFAULT_POOL, ("a",)).saturated
    uncapped.table.offer(snap(2, node("a", 1, routable=False)), now=1)
    assert why(uncapped, DEFAULT_POOL) == Refusal(RefusalCause.NO_ROUTABLE_NODE)


def _drive(policy: str, script: list[tuple[str, int]]) -> list[str]:
    """Run one scripted sequence of snapshots, admissions, first bytes and releases; the picks."""
    router = Router(policy, seed=11, proxy_id="p1")
    open_: list[Admission] = []
    picks: list[str] = []
    seq = 0
    for op, arg in script:
        if op == "snapshot":
            seq += 1
            rng = random.Random(arg)
            router.table.offer(snap(seq, *(node(n, rng.choice([0.0, 0.5, 1.0, 2.0, 4.0]), capacity=8)
                                     for n in "abcde")), now=float(seq))
        elif op == "admit":
            text = prompt_text([{"role": "user", "content": f"conversation {arg % 7} " * (40 + arg % 50)}], None)
            admission = admit(router, DEFAULT_POOL, prompt=text, size=request_size(text, 64, None))
            picks.append(admission.node if admission is not None else "-")
            if admission is not None:
                open_.append(admission)
        elif op == "first_byte" and open_:
            router.admitter.prefilled(open_[arg % len(open_)])
        elif op == "release" and open_:
            router.admitter.release(open_.pop(arg % len(open_)))
    return picks


def _script() -> list[tuple[str, int]]:
    rng = random.Random(2026)
    ops = ["snapshot"] + [rng.choice(["admit"] * 5 + ["first_byte", "release", "release", "snapshot"])
                          for _ in range(400)]
    return [(op, rng.randrange(1 << 16)) for op in ops]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_same_inputs_give_the_same_picks_in_any_process(name: str) -> None:
    """Replay-style: the Router the proxy and bench --virtual run is a function of its inputs
    and seed, also in another process with another string-hash seed (no set or dict order leaks
    into a pick)."""
    picks = _drive(name, _script())
    assert len(set(picks)) > 1
    code = ("import json, sys; from tests.scheduler.test_routing_core import _drive, _script; "
            "print(json.dumps(_drive(sys.argv[1], _script())))")
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", code, name], cwd=ROOT, env=env, capture_output=True,
                             text=True, check=True).stdout
        assert json.loads(out) == picks
