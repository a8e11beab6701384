"""The protocol every pick policy implements, the context of a pick, and the unit of weight.

A policy is a small stateful object owned by one proxy: ``set_candidates`` takes the routable
nodes of the newest snapshot (weights in milli-units, integers), ``pick(ctx)`` chooses one node.
Every policy has that one call; the ``PickContext`` (Envoy's ``LoadBalancerContext``) carries
everything a pick may look at, and a policy reads what it uses and ignores the rest:

* ``inflight``: each node's in-flight count (the proxy's pool-wide estimate,
  ``scheduler.routing.load``); every policy but round robin reads it;
* ``exclude``: nodes the pick must not return (tried for this request, or over a limit);
* ``affinity``: the request's work and prefix preference (``policies.affinity.Affinity``), or
  None; only policies with ``uses_affinity`` read it, and the router builds it only for them.

A new field (a request's priority) is a field here with a default: the policies that do not use
it need no change. Prefill/decode roles are not a field: a P/D pool's route holds one policy per
role (``scheduler.routing.route``). Randomness comes only from the ``Rng`` the caller
seeded. A candidate of weight 0 is never picked.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from laswrr.scheduler.policies.affinity import Affinity
from laswrr.scheduler.rng import Rng

WEIGHT_UNIT = 1000  # snapshot weights have three decimals; policies work on integers


@dataclass(frozen=True, slots=True)
class Candidate:
    node: str
    weight: int  # effective weight x WEIGHT_UNIT; 0 = not eligible

    @classmethod
    def from_weight(cls, node: str, effective_weight: float) -> "Candidate":
        return cls(node, max(0, round(effective_weight * WEIGHT_UNIT)))


@dataclass(slots=True)
class PickContext:
    """What one pick may look at (module docstring); a policy may ignore any of it, and writes
    none of it (not frozen: a frozen dataclass costs ~0.3 µs more to build, once per pick)."""

    inflight: Mapping[str, int] = field(default_factory=dict)
    exclude: Container[str] = ()
    affinity: Affinity | None = None


class Policy(Protocol):
    name: ClassVar[str]
    uses_affinity: ClassVar[bool]  # reads ``PickContext.affinity`` (the router keeps a prefix index for it)

    def set_candidates(self, candidates: Sequence[Candidate]) -> None: ...

    def pick(self, ctx: PickContext) -> str | None: ...


def eligible_names(candidates: Sequence[Candidate]) -> list[str]:
    """The nodes a weight-blind policy may pick from, in candidate order."""
    return [c.node for c in candidates if c.weight > 0]


class WeightBlind:
    """What the policies that ignore weights beyond eligibility share: the caller's Rng and the
    eligible node names of the newest snapshot, in candidate order."""

    uses_affinity: ClassVar[bool] = False

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
