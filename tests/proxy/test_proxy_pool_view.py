"""One load view across replicas: each proxy picks on the pool-wide in-flight estimate
``others + own`` (scheduler/routing/router.py), where ``others`` comes from the snapshot's
``inflight`` less the snapshot's own share (``proxy_inflight[proxy_id]``).

Pure tests of the estimator (two real proxies on one bus: test_proxy_replicas.py).
"""

from __future__ import annotations

import random
import zlib

import pytest

from laswrr.scheduler.policies import Candidate, PickContext, make_policy
from tests.scheduler.routing_help import admit
from laswrr.schemas.outputs import LoadView, NodeView, WeightSnapshot
from laswrr.scheduler.routing.router import Admission, Router, others_inflight

LOAD = LoadView(queue=0, running=0, kv=0, npu=0, latency=0, load=0, sample_age_ms=None, stale=False)


def view(name: str, weight: float, inflight: int = 0, capacity: int = 8) -> NodeView:
    return NodeView(node=name, url=f"http://{name}:8000", phase="active", routable=True, capacity=capacity,
                    target_weight=weight, effective_weight=weight, inflight=inflight, chip="910B", health=1.0,
                    load=LOAD)


def snap(seq: int, nodes: list[NodeView], split: dict[str, dict[str, int]] | None = None,
         pool: str = "default") -> WeightSnapshot:
    return WeightSnapshot(pool=pool, as_of_seq=seq, tick=seq, ts_ns=0, panic=False, nodes=nodes,
                          proxy_inflight=split or {})


# -- the estimator ---------------------------------------------------------------------------------

def test_others_are_the_snapshot_count_less_this_proxys_share() -> None:
    s = snap(1, [view("a", 4, inflight=5), view("b", 4, inflight=2), view("c", 4)],
             {"me": {"a": 2, "b": 2}, "other": {"a": 3}})
    assert others_inflight(s, "me") == {"a": 3}
    assert others_inflight(s, "other") == {"a": 2, "b": 2}
    assert others_inflight(s, "new") == {"a": 5, "b": 2}  # a replica the scheduler has not seen yet
    # no split (nothing open, or a scheduler from before the field): own counts alone
    assert others_inflight(snap(1, [view("a", 4, inflight=5)]), "me") == {}
    assert others_inflight(s, None) == {}  # a router that does not know its own share


def test_the_estimate_is_others_plus_own_live_count() -> None:
    router = Router("la-swrr", seed=1, proxy_id="me")
    router.table.offer(snap(1, [view("a", 4, inflight=3), view("b", 4)], {"other": {"a": 3}}), now=0)
    assert router.table.load.load == {"a": 3}
    picks = [admit(router, "default") for _ in range(3)]
    assert [p.node for p in picks if p] == ["b", "b", "b"]  # a carries the other replica's three
    assert router.table.load.load == {"a": 3, "b": 3} and router.table.load.own == {"b": 3}
    # the scheduler has seen two of ours now, and the other replica's finished
    router.table.offer(snap(2, [view("a", 4), view("b", 4, inflight=2)], {"me": {"b": 2}}), now=1)
    assert router.table.load.load == {"b": 3}  # own live count, counted once
    for admission in picks:
        assert admission is not None
        router.admitter.release(admission)
    assert router.table.load.load == {} and router.table.load.own == {}


def test_the_cap_applies_to_the_estimate() -> None:
    router = Router("least-request", seed=0, proxy_id="me", inflight_cap_per_capacity=0.5)
    router.table.offer(snap(1, [view("a", 4, inflight=2, capacity=4), view("b", 4, capacity=4)],
                      {"other": {"a": 2}}), now=0)
    picks = [admit(router, "default") for _ in range(4)]
    assert [p.node if p else None for p in picks] == ["b", "b", None, None]  # a is at 2 = ceil(0.5 x 4)


def test_forgetting_a_pool_forgets_its_others() -> None:
    router = Router("la-swrr", seed=1, proxy_id="me")
    router.table.offer(snap(1, [view("a", 4, inflight=3)], {"other": {"a": 3}}, pool="x"), now=0)
    router.table.offer(snap(1, [view("b", 4, inflight=1)], {"other": {"b": 1}}, pool="y"), now=0)
    assert router.table.load.load == {"a": 3, "b": 1}
    router.table.forget("x")
    assert router.table.load.load == {"b": 1}


class OldReferee:
    """The referee before the pool-wide view: the pool's policy picking on own counts alone
    (same seed derivation and candidates as ``Router``)."""

    def __init__(self, policy: str, seed: int, pool: str = "default") -> None:
        self.policy = make_policy(policy, (seed ^ zlib.crc32(pool.encode())) & ((1 << 64) - 1))
        self.own: dict[str, int] = {}

    def install(self, snapshot: WeightSnapshot) -> None:
        self.policy.set_candidates([Candidate.from_weight(n.node, n.effective_weight) for n in snapshot.nodes])

    def admit(self, exclude: set[str]) -> str | None:
        node = self.policy.pick(PickContext(self.own, exclude))
        if node is not None:
            self.own[node] = self.own.get(node, 0) + 1
        return node

    def release(self, node: str) -> None:
        self.own[node] -= 1
        if not self.own[node]:
            del self.own[node]


@pytest.mark.parametrize("policy", ["la-swrr", "least-request", "p2c"])
@pytest.mark.parametrize("seed", range(6))
def test_with_one_replica_the_picks_are_exactly_the_old_referees(policy: str, seed: int) -> None:
    """One proxy: every snapshot's in-flight is its own (as of a lagging moment), so others are
    0 and each pick is the one the own-count referee makes on the same inputs."""
    rng = random.Random(seed)
    names = ["a", "b", "c", "d"]
    new, old = Router(policy, seed=seed, proxy_id="solo"), OldReferee(policy, seed)
    held: list[Admission] = []
    history: list[dict[str, int]] = [{}]  # own counts after each step: what a lagging scheduler saw
    seq = 0
    picks_new, picks_old = [], []
    for step in range(400):
        roll = rng.random()
        if roll < 0.08 or step == 0:
            seq += 1
            seen = history[max(0, len(history) - 1 - rng.randrange(5))]  # 0..4 steps behind
            weights = {n: rng.choice([1, 2, 4, 8]) for n in names}
            snapshot = snap(seq, [view(n, weights[n], inflight=seen.get(n, 0)) for n in names],
                            {"solo": {n: c for n, c in sorted(seen.items()) if c}} if seen else None)
            new.table.offer(snapshot, now=step)
            old.install(snapshot)
        elif roll < 0.6 or not held:
            tried = set(rng.sample(names, rng.choice([0, 0, 0, 1, 2])))
            admission = admit(new, "default", tried=tried)
            picks_new.append(admission.node if admission else None)
            picks_old.append(old.admit(tried))
            if admission is not None:
                held.append(admission)
        else:
            admission = held.pop(rng.randrange(len(held)))
            new.admitter.release(admission)
            old.release(admission.node)
        assert new.table.load.load == new.table.load.own == old.own
        history.append(dict(new.table.load.own))
    assert picks_new == picks_old
    assert len(set(picks_new)) > 1
