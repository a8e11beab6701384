"""Power of two choices: two distinct nodes drawn uniformly, the one with fewer in-flight wins.

Distinct draws as Ray Serve and the SGLang router do; a tie keeps the first draw. Weights are
ignored beyond eligibility (this is the popular routers' default, our baseline).
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from typing import ClassVar

from scheduler.policies.base import Candidate, eligible
from scheduler.rng import Rng


class PowerOfTwo:
    name: ClassVar[str] = "p2c"

    def __init__(self, rng: Rng) -> None:
        self.rng = rng
        self.candidates: list[Candidate] = []

    def set_candidates(self, candidates: Sequence[Candidate]) -> None:
        self.candidates = list(candidates)

    def pick(self, inflight: Mapping[str, int], exclude: Container[str] = ()) -> str | None:
        pool = eligible(self.candidates, exclude)
        if len(pool) <= 1:
            return pool[0].node if pool else None
        first = self.rng.below(len(pool))
        second = self.rng.below(len(pool) - 1)
        if second >= first:
            second += 1
        a, b = pool[first].node, pool[second].node
        return b if inflight.get(b, 0) < inflight.get(a, 0) else a
