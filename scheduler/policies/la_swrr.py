"""LA-SWRR pick: SWRR over effective weights, refereed by power-of-two on live in-flight.

Each pick runs one nginx SWRR add step over the eligible nodes, then looks at SWRR's two
highest accumulators (the "two choices"). SWRR's leader wins unless its live in-flight per unit
of weight is strictly higher than the runner-up's (compared by cross-multiplication, integers
only): in-flight counts are the proxy's own and never stale, snapshot weights may be 100 ms old.
The SWRR charge (cw -= total) goes to the node actually chosen, so Σ cw = 0 still holds. If the
leader was passed over, its credit above one full round (total) is forfeited to the chosen node:
a node that stays busy cannot hoard credit and burst when it frees up.

With equal per-weight load (for instance no traffic in flight) the referee never intervenes
and the sequence is exactly nginx's (5,1,1 -> a a b a c a a). A seed-dependent number of
warm-up passes at the first snapshot desynchronises replicas (Envoy's createWithPicks).
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from typing import ClassVar

from scheduler.policies.base import Candidate
from scheduler.rng import Rng
from scheduler.swrr import Swrr


class LaSwrr:
    name: ClassVar[str] = "la-swrr"

    def __init__(self, rng: Rng, warmup: bool = True) -> None:
        self.rng = rng
        self.swrr = Swrr()
        self.warmup_pending = warmup

    def set_candidates(self, candidates: Sequence[Candidate]) -> None:
        self.swrr.set_weights([(c.node, c.weight) for c in candidates])
        if self.warmup_pending and candidates:
            self.warmup_pending = False
            for _ in range(self.rng.below(max(1, len(candidates)))):
                self.swrr.pick()

    def pick(self, inflight: Mapping[str, int], exclude: Container[str] = ()) -> str | None:
        swrr = self.swrr
        eligible, total = swrr.add_step(exclude)
        leader = swrr.best(eligible)
        if leader is None:
            return None
        runner_up = swrr.best(eligible, skip=leader)
        chosen = leader
        if runner_up is not None:
            w_lead, w_run = swrr.weights[leader], swrr.weights[runner_up]
            if inflight.get(leader, 0) * w_run > inflight.get(runner_up, 0) * w_lead:
                chosen = runner_up
        swrr.charge(chosen, total)
        if chosen != leader and swrr.current[leader] > total:
            excess = swrr.current[leader] - total
            swrr.current[leader] = total
            swrr.current[chosen] += excess
        return chosen
