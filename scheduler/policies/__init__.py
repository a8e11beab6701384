"""Pick policies as peers behind one protocol, chosen by name (Envoy's layout).

Names: ``la-swrr``, ``rr``, ``least-request``, ``p2c``; ``POLICY_ALIASES`` adds the spellings of
the peer routers (SGLang router, vllm-router: ``round_robin``, ``power_of_two``,
``least_request``), with ``_`` and ``-`` interchangeable and case ignored. ``canonical_policy`` maps any of them to the name.
"""

from __future__ import annotations

from laswrr.scheduler.policies.base import WEIGHT_UNIT, Candidate, PickContext, Policy
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

POLICY_ALIASES: dict[str, str] = {"round-robin": RoundRobin.name, "power-of-two": PowerOfTwo.name}


def canonical_policy(name: str) -> str:
    """A policy name or alias (any case, ``_`` or ``-``) -> the policy's name; ValueError on anything else."""
    key = name.strip().lower().replace("_", "-")
    key = POLICY_ALIASES.get(key, key)
    if key not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)} "
                         "(or round_robin, power_of_two, least_request)")
    return key


def make_policy(name: str, seed: int = 0) -> Policy:
    return POLICIES[canonical_policy(name)](Rng(seed))


__all__ = ["Candidate", "PickContext", "Policy", "POLICIES", "POLICY_ALIASES", "WEIGHT_UNIT", "canonical_policy", "make_policy"]
