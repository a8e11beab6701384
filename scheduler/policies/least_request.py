"""Least request, full scan: the node with the fewest in-flight requests (``PickContext.inflight``).

Ties are broken uniformly with the caller's Rng: one draw among the tied nodes (the effect of
Envoy's FULL_SCAN reservoir sampling, with a single draw). Weights are ignored beyond
eligibility.
"""

from __future__ import annotations

from typing import ClassVar

from laswrr.scheduler.policies.base import PickContext, WeightBlind, without


class LeastRequest(WeightBlind):
    name: ClassVar[str] = "least-request"

    def pick(self, ctx: PickContext) -> str | None:
        names = without(self.names, ctx.exclude)
        if not names:
            return None
        inflight = ctx.inflight
        loads = [inflight.get(n, 0) for n in names]
        least = min(loads)
        tied = [n for n, load in zip(names, loads) if load == least]
        return tied[0] if len(tied) == 1 else tied[self.rng.below(len(tied))]
