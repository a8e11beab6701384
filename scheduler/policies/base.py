"""The protocol every pick policy implements, and the unit of weight proxies pass in.

A policy is a small stateful object owned by one proxy: ``set_candidates`` takes the routable
nodes of the newest snapshot (weights in milli-units, integers), ``pick`` chooses one node given
the proxy's own live in-flight counts and the nodes already tried for this request. Randomness
comes only from the ``Rng`` the caller seeded. A candidate of weight 0 is never picked.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from laswrr.scheduler.rng import Rng

WEIGHT_UNIT = 1000  # snapshot weights have three decimals; policies work on integers


@dataclass(frozen=True, slots=True)
class Candidate:
    node: str
    weight: int  # effective weight x WEIGHT_UNIT; 0 = not eligible

    @classmethod
    def from_weight(cls, node: str, effective_weight: float) -> "Candidate":
        return cls(node, max(0, round(effective_weight * WEIGHT_UNIT)))


class Policy(Protocol):
    name: ClassVar[str]

    def set_candidates(self, candidates: Sequence[Candidate]) -> None: ...

    def pick(self, inflight: Mapping[str, int], exclude: Container[str] = ()) -> str | None: ...


def eligible_names(candidates: Sequence[Candidate]) -> list[str]:
    """The nodes a weight-blind policy may pick from, in candidate order."""
    return [c.node for c in candidates if c.weight > 0]


class WeightBlind:
    """What the policies that ignore weights beyond eligibility share: the caller's Rng and the
    eligible node names of the newest snapshot, in candidate order."""

    def __init__(self, rng: Rng) -> None:
        self.rng = rng
        self.names: list[str] = []

    def set_candidates(self, candidates: Sequence[Candidate]) -> None:
        self.names = eligible_names(candidates)


def without(names: list[str], exclude: Container[str]) -> list[str]:
    """``names`` minus ``exclude``; the list itself when nothing is excluded (the common case)."""
    if not exclude:
        return names
    return [n for n in names if n not in exclude]
