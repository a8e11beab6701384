"""LA-SWRR pick: SWRR over effective weights, refereed by power-of-two on live in-flight.

Each pick runs one nginx SWRR add step over the eligible nodes and looks at SWRR's two highest
accumulators (the "two choices"): the leader L and the runner-up R. In-flight counts are the
proxy's own and never stale; snapshot weights may be 100 ms old. The referee:

    choose R  iff  inflight_L / w_L  >  (inflight_R + 1) / w_R      (cross-multiplied, integers)

i.e. the runner-up takes the request only if, even after taking it, it is still less loaded per
unit of weight than the leader is now. Without that "+1" the referee would fire on any single
request in flight on a heavy leader and wash out the weights at low concurrency (weights 11:19
with three requests in flight came out 50:50); with it, equal per-weight load (including no
load at all) never triggers it and the sequence is exactly nginx's (5,1,1 -> a a b a c a a),
while a node that is really backed up loses its turns to the runner-up.

The SWRR charge (cw -= total) goes to the node actually chosen, so Σ cw = 0 still holds. If the
leader was passed over, its credit above one full round (total) is forfeited to the chosen node:
a node that stays busy cannot hoard credit and burst when it frees up. A seed-dependent number
of warm-up passes at the first snapshot desynchronises replicas (Envoy's createWithPicks).
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
        lead, run, total = swrr.pass_(exclude)
        if lead < 0:
            return None
        chosen = lead
        if run >= 0:
            nodes, weights = swrr.nodes, swrr.weights
            if inflight.get(nodes[lead], 0) * weights[run] > (inflight.get(nodes[run], 0) + 1) * weights[lead]:
                chosen = run
        cw = swrr.cw
        cw[chosen] -= total
        if chosen != lead and cw[lead] > total:
            cw[chosen] += cw[lead] - total
            cw[lead] = total
        return swrr.nodes[chosen]
