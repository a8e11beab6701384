"""Pick policies as peers behind one protocol, chosen by name (Envoy's layout)."""

from __future__ import annotations

from laswrr.scheduler.policies.base import WEIGHT_UNIT, Candidate, Policy
from laswrr.scheduler.policies.la_swrr import LaSwrr
from laswrr.scheduler.policies.least_request import LeastRequest
from laswrr.scheduler.policies.p2c import PowerOfTwo
from laswrr.scheduler.policies.round_robin import RoundRobin
from laswrr.scheduler.rng import Rng

POLICIES: dict[str, type[LaSwrr] | type[RoundRobin] | type[LeastRequest] | type[PowerOfTwo]] = {
    LaSwrr.name: LaSwrr,
    RoundRobin.name: RoundRobin,
    LeastRequest.name: LeastRequest,
    PowerOfTwo.name: PowerOfTwo,
}


def make_policy(name: str, seed: int = 0) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    return cls(Rng(seed))


__all__ = ["Candidate", "Policy", "POLICIES", "WEIGHT_UNIT", "make_policy"]
