"""LA-SWRR pick: SWRR over effective weights, refereed by live in-flight against the lightest node.

Each pick runs one nginx SWRR add step over the eligible nodes; the node with the highest
accumulator is the leader L. The challenger C is the eligible node that would be lightest per
unit of weight after taking the request (least ``(inflight + 1) / w``; ties: higher accumulator,
then list order). In-flight counts are the proxy's pool-wide estimate (scheduler/routing/load.py):
its own requests live, never stale, plus the other replicas' as of the snapshot; snapshot
weights (and those other replicas' counts) may be a tick (100 ms) old. The referee:

    choose C  iff  inflight_L / w_L  >=  (inflight_C + 1) / w_C      (cross-multiplied, integers)

i.e. the challenger takes the request if, even after taking it, it is at most as loaded per unit
of weight as the leader is now. The "+1" keeps the weights at low concurrency: one request in
flight on a heavy leader (1/5 per weight) does not send the next one to an idle light node (it
would then be at 1/1). Equal per-weight load (including no load at all) never triggers it, so the
sequence is exactly nginx's (5,1,1 -> a a b a c a a). The ">=" settles the one-request gap: with
equal weights the leader yields whenever another node has fewer requests in flight, so a
homogeneous pool is kept as level as least-request keeps it. Looking at the lightest node rather
than at SWRR's runner-up is what lets that node be found in any position of the rotation.

The SWRR charge (cw -= total) goes to the node actually chosen, so Σ cw = 0 still holds. If the
leader was passed over, its credit above one full round (total) is forfeited to the chosen node:
a node that stays busy cannot hoard credit and burst when it frees up. A seed-dependent number
of warm-up passes at the first snapshot desynchronises replicas (Envoy's createWithPicks).

**Work** (optional: the pick context's ``affinity``, a ``policies.affinity.Affinity``, given when
the proxy knows the request's size and affinity is on; ``uses_affinity`` says LA-SWRR reads it). The referee then weighs work instead of requests: each node's
load L (prefill backlog plus one mean prompt per request in flight) and the request's cost k on
it (its uncached prompt there plus one mean prompt), both after taking the request:

    choose C  iff  (L_L + k_L) / w_L  >  (L_C + k_C) / w_C      C: least (L + k) / w

A node holding the prompt's prefix costs less, so the referee itself is cache-aware; the leader
keeps ties, and a leader with no load at all keeps the request (the SWRR rotation). With equal
costs and no backlog this is the rule above in other units (equal weights: exactly). Then the first preferred node that
is eligible and passes the guard (``guard_allows`` against the eligible node lightest in
work per weight after taking the request) takes the request instead. It is charged like any
chosen node (Σ cw = 0, the leader's excess forfeited), so affinity picks count against the
node's SWRR share; a node's debt is capped at one round (cw >= -total, the excess taken from the
leader), so a run of affinity picks cannot starve it of its turns later (the cap applies to
affinity picks only: without them every accumulator moves exactly as above). With no preferred node
(or none passing the guard) the pick is exactly the one above.

**Prefill speed** (a P/D pool's prefill pick, when the proxy has measured its prefill nodes at
different speeds: ``Affinity.speed``). A prefill node's weight is its capacity, not how fast it
prefills, and a node that prefills at half speed while nothing queues on it looks as light as
the others: the rotation would give it its share of long prompts, each taking twice as long
before its first token. With speeds, load and cost are divided by the node's speed (work in the
fastest node's tokens, i.e. time), and an idle leader keeps the request only if it is at least
as fast as the node the referee found: a request goes to the slower node when the faster one's
work ahead of it exceeds what the slower one loses on the request itself. Without speeds (every
other pool, and a P/D pool until two prefill nodes differ) nothing changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from laswrr.scheduler.policies.affinity import Affinity, guard_allows
from laswrr.scheduler.policies.base import Candidate, PickContext
from laswrr.scheduler.rng import Rng
from laswrr.scheduler.swrr import Swrr


class LaSwrr:
    name: ClassVar[str] = "la-swrr"
    uses_affinity: ClassVar[bool] = True

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

    def pick(self, ctx: PickContext) -> str | None:
        swrr = self.swrr
        lead, total, active = swrr.add_step(ctx.exclude)
        if lead < 0:
            return None
        nodes, cw = swrr.nodes, swrr.cw
        affinity = ctx.affinity
        if affinity is None:
            chosen = refereed = self._referee(ctx.inflight, lead, active)
        else:
            chosen, refereed = self._weigh(affinity, lead, active)
        cw[chosen] -= total
        if chosen != lead and cw[lead] > total:
            cw[chosen] += cw[lead] - total
            cw[lead] = total
        if chosen != refereed and cw[chosen] < -total:  # an affinity pick's debt: one round at most
            cw[lead] -= -total - cw[chosen]
            cw[chosen] = -total
        return nodes[chosen]

    def _referee(self, inflight: Mapping[str, int], lead: int, active: list[int]) -> int:
        """The request referee: the leader, or the node lightest after taking the request if the
        leader is at least as loaded now."""
        swrr = self.swrr
        nodes, weights, cw = swrr.nodes, swrr.weights, swrr.cw
        lead_inflight = inflight.get(nodes[lead], 0)
        if not lead_inflight:
            return lead
        best = -1
        best_after = best_weight = 0
        for i in active:
            after = inflight.get(nodes[i], 0) + 1
            # after / weights[i] < best_after / best_weight, or equal with a higher accumulator
            lhs, rhs = after * best_weight, best_after * weights[i]
            if best < 0 or lhs < rhs or (lhs == rhs and cw[i] > cw[best]):
                best, best_after, best_weight = i, after, weights[i]
        if best != lead and lead_inflight * best_weight >= best_after * weights[lead]:
            return best
        return lead

    def _weigh(self, affinity: Affinity, lead: int, active: list[int]) -> tuple[int, int]:
        """(the pick, the work referee's pick): the referee, then the guarded preference."""
        if affinity.speed:
            return self._weigh_timed(affinity, lead, active)
        swrr = self.swrr
        nodes, weights, cw = swrr.nodes, swrr.weights, swrr.cw
        backlog, counts, mean = affinity.backlog, affinity.counts, affinity.mean
        costs, base = affinity.costs, affinity.cost
        best = -1
        best_load = best_after = best_weight = lead_after = 0
        for i in active:  # least (load + cost) / w; ties: higher accumulator, then list order
            node = nodes[i]
            load = backlog.get(node, 0) + mean * counts.get(node, 0)
            after = load + costs.get(node, base)
            if i == lead:
                lead_after = after
            lhs, rhs = after * best_weight, best_after * weights[i]
            if best < 0 or lhs < rhs or (lhs == rhs and cw[i] > cw[best]):
                best, best_load, best_after, best_weight = i, load, after, weights[i]
        lead_idle = lead_after == costs.get(nodes[lead], base)  # no load on the leader: it keeps the request
        chosen = best if not lead_idle and lead_after * best_weight > best_after * weights[lead] else lead
        if affinity.preferred:
            index, eligible = swrr.index, set(active)
            for node in affinity.preferred:
                i = index.get(node, -1)
                if i in eligible and guard_allows(affinity.load(node), weights[i], best_load, best_weight,
                                                  best_after - best_load):
                    return i, chosen
        return chosen, chosen

    def _weigh_timed(self, affinity: Affinity, lead: int, active: list[int]) -> tuple[int, int]:
        """``_weigh`` with the nodes' prefill speeds (module doc, "Prefill speed")."""
        swrr = self.swrr
        nodes, weights, cw = swrr.nodes, swrr.weights, swrr.cw
        best = -1
        best_load = best_after = lead_after = lead_load = 0.0
        best_weight = 0
        for i in active:  # least (load + cost) / (speed w); ties: higher accumulator, then list order
            node = nodes[i]
            load = affinity.timed(node, affinity.load(node))
            after = load + affinity.timed(node, affinity.cost_on(node))
            if i == lead:
                lead_after, lead_load = after, load
            lhs, rhs = after * best_weight, best_after * weights[i]
            if best < 0 or lhs < rhs or (lhs == rhs and cw[i] > cw[best]):
                best, best_load, best_after, best_weight = i, load, after, weights[i]
        speed = affinity.speed
        lead_idle = lead_load == 0 and speed.get(nodes[lead], 1.0) >= speed.get(nodes[best], 1.0)
        chosen = best if not lead_idle and lead_after * best_weight > best_after * weights[lead] else lead
        if affinity.preferred:  # the guard as in ``_weigh``, on time
            index, eligible = swrr.index, set(active)
            for node in affinity.preferred:
                i = index.get(node, -1)
                if i in eligible and guard_allows(affinity.timed(node, affinity.load(node)), weights[i], best_load,
                                                  best_weight, best_after - best_load):
                    return i, chosen
        return chosen, chosen
