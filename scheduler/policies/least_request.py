"""Least request, full scan: the node with the fewest in-flight requests of this proxy.

Ties are broken uniformly with the caller's Rng (reservoir sampling over the tied nodes, as
Envoy's FULL_SCAN does). Weights are ignored beyond eligibility.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from typing import ClassVar

from scheduler.policies.base import Candidate, eligible
from scheduler.rng import Rng


class LeastRequest:
    name: ClassVar[str] = "least-request"

    def __init__(self, rng: Rng) -> None:
        self.rng = rng
        self.candidates: list[Candidate] = []

    def set_candidates(self, candidates: Sequence[Candidate]) -> None:
        self.candidates = list(candidates)

    def pick(self, inflight: Mapping[str, int], exclude: Container[str] = ()) -> str | None:
        best: str | None = None
        best_load = 0
        ties = 0
        for candidate in eligible(self.candidates, exclude):
            load = inflight.get(candidate.node, 0)
            if best is None or load < best_load:
                best, best_load, ties = candidate.node, load, 1
            elif load == best_load:
                ties += 1
                if self.rng.below(ties) == 0:
                    best = candidate.node
        return best
