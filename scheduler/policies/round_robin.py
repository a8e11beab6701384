"""Round robin: each eligible node in turn, weights ignored (the baseline LA-SWRR must beat).

The starting offset comes from the seed so replicas do not move in lockstep (Envoy seeds its
rr_index randomly for the same reason).
"""

from __future__ import annotations

from typing import ClassVar

from laswrr.scheduler.policies.base import PickContext, WeightBlind, without
from laswrr.scheduler.rng import Rng


class RoundRobin(WeightBlind):
    name: ClassVar[str] = "rr"

    def __init__(self, rng: Rng) -> None:
        super().__init__(rng)
        self.index = rng.below(1 << 16)

    def pick(self, ctx: PickContext) -> str | None:
        names = without(self.names, ctx.exclude)
        if not names:
            return None
        self.index += 1
        return names[self.index % len(names)]
