"""Power of two choices: two distinct nodes drawn uniformly, the one with fewer in-flight wins.

Distinct draws as Ray Serve and the SGLang router do; a tie keeps the first draw. Weights are
ignored beyond eligibility (this is the popular routers' default, our baseline).
"""

from __future__ import annotations

from typing import ClassVar

from laswrr.scheduler.policies.base import PickContext, WeightBlind, without


class PowerOfTwo(WeightBlind):
    name: ClassVar[str] = "p2c"

    def pick(self, ctx: PickContext) -> str | None:
        names = without(self.names, ctx.exclude)
        if len(names) <= 1:
            return names[0] if names else None
        first = self.rng.below(len(names))
        second = self.rng.below(len(names) - 1)
        if second >= first:
            second += 1
        a, b = names[first], names[second]
        inflight = ctx.inflight
        return b if inflight.get(b, 0) < inflight.get(a, 0) else a
