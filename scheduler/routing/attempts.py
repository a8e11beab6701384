"""What the forwarder does after each attempt, in one table (as ``scheduler/phases.py``): sans-IO.

A client request runs as a sequence of attempts, each on one node, each one **leg**:

* ``whole``: the request on a node that serves it whole (a pool without roles);
* ``prefill``: a ``vllm`` pair's prefill leg (its answer: the KV params the decode leg takes);
* ``decode``: a ``vllm`` pair's decode leg, or a short request sent to a decode node alone;
* ``pair``: an ``sglang`` pair's decode leg, its prefill leg running beside it.

Each attempt ends in one **outcome**: ``done`` (its answer is the client's: whole, or cut by the
engine where it could not be continued), ``failed`` (before any byte of it reached the client, and
another node may be tried), ``refused`` (before any byte, but the answer is the client's: an engine's
4xx to a prefill leg, a continuation answered with anything but SSE), ``broken`` (a continuable stream
broke after the client got part of it), ``partner_failed`` (an sglang decode leg cancelled because its
prefill leg failed: the decode node is not at fault). ``TRANSITIONS`` maps (leg, outcome) to the
**step**, and ``decide`` checks the step against the budget:

    leg      done     failed    refused   broken            partner_failed
    whole    answer   retry     give up   continue          -
    prefill  decode   retry     give up   -                 -
    decode   answer   retry     give up   continue_on_pair  -
    pair     answer   new_pair  give up   continue_on_pair  new_pair

These rows are the "never cut" rules (docs/proxy.md, "Streams that survive their engine"): an attempt that fails before the client's
first byte is retried on another node (never one already tried) while ``max_retries`` allows; a
``vllm`` decode leg is retried on another decode node with the same KV params, a failed ``sglang``
pair with a new pair; after the first byte a break is continued on another node (a new pair in a P/D
pool) while ``continue_limit`` allows; a continuation that fails before its first event is retried
like any attempt. ``retry`` and ``new_pair`` spend a retry, the two ``continue`` steps a
continuation; a step whose budget is spent gives up (``GiveUp``), and so does one for which the
driver finds no untried node (``GiveUp.NO_NODE``). Giving up answers the last failure, or ends the
client's stream with an error event: the router never cuts an admitted request itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum, auto

from laswrr.schemas.words import PdProtocol

__all__ = ["Leg", "Outcome", "Step", "GiveUp", "Budget", "Decision", "TRANSITIONS", "RETRIES", "CONTINUATIONS",
           "AttemptError", "decide", "pair_leg", "next_leg", "attempt_id", "give_up_text", "WHOLE", "DONE", "ANSWER",
           "GIVE_UP"]


class Leg(StrEnum):
    """What one attempt is (module header); ``auto()``: each value is its name in lower case."""

    WHOLE = auto()
    PREFILL = auto()
    DECODE = auto()
    PAIR = auto()


class Outcome(StrEnum):
    """How one attempt ended, as far as what follows is concerned (module header)."""

    DONE = auto()
    FAILED = auto()
    REFUSED = auto()
    BROKEN = auto()
    PARTNER_FAILED = auto()


class Step(StrEnum):
    """What the forwarder does next."""

    ANSWER = auto()  # the attempt's answer was the client's: nothing follows
    DECODE = auto()  # the pair's decode leg, on the pair's decode node (spends nothing)
    RETRY = auto()  # the same leg on another node of its role (a vllm decode leg: the same KV params)
    NEW_PAIR = auto()  # the request again, on a new prefill/decode pair
    CONTINUE = auto()  # the continuation request, on another node
    CONTINUE_ON_PAIR = auto()  # the continuation request, on a new prefill/decode pair
    GIVE_UP = auto()  # answer the last failure, or end the client's stream with an error event


class GiveUp(StrEnum):
    """Why nothing follows a failed or broken attempt."""

    NOT_RETRYABLE = auto()  # the failure is the client's answer
    NO_RETRY_LEFT = auto()  # max_retries spent
    CONTINUE_LIMIT = auto()  # continue_limit reached
    NO_NODE = auto()  # no untried node (or pair) could take it


# The members the forwarder reads for every request, as module constants: on CPython 3.11 reading
# ``Leg.WHOLE`` goes through EnumType.__getattr__, several times the comparison's cost
# (docs/evidence/code-choices.md).
WHOLE, DONE, ANSWER, GIVE_UP = Leg.WHOLE, Outcome.DONE, Step.ANSWER, Step.GIVE_UP

# leg: the step after each outcome, in ``Outcome``'s order (done, failed, refused, broken, partner_failed),
# as in the module header; None: the leg cannot end so (``AttemptError``).
_GRID: dict[Leg, tuple[Step | None, ...]] = {
    Leg.WHOLE: (Step.ANSWER, Step.RETRY, Step.GIVE_UP, Step.CONTINUE, None),
    Leg.PREFILL: (Step.DECODE, Step.RETRY, Step.GIVE_UP, None, None),
    Leg.DECODE: (Step.ANSWER, Step.RETRY, Step.GIVE_UP, Step.CONTINUE_ON_PAIR, None),
    Leg.PAIR: (Step.ANSWER, Step.NEW_PAIR, Step.GIVE_UP, Step.CONTINUE_ON_PAIR, Step.NEW_PAIR),
}
TRANSITIONS: dict[tuple[Leg, Outcome], Step] = {
    (leg, outcome): step for leg, steps in _GRID.items() for outcome, step in zip(Outcome, steps, strict=True)
    if step is not None}

RETRIES = frozenset({Step.RETRY, Step.NEW_PAIR})  # the steps that spend a retry
CONTINUATIONS = frozenset({Step.CONTINUE, Step.CONTINUE_ON_PAIR})  # the steps that spend a continuation


class AttemptError(ValueError):
    """An outcome a leg cannot have (a prefill leg is read whole: it never breaks mid-stream)."""


@dataclass(frozen=True, slots=True)
class Budget:
    """What a client request may still spend: retries before a first byte, continuations after it."""

    max_retries: int
    continue_limit: int
    retries: int = 0  # spent
    continuations: int = 0  # spent

    def spend(self, step: Step) -> Budget:
        if step in RETRIES:
            return replace(self, retries=self.retries + 1)
        if step in CONTINUATIONS:
            return replace(self, continuations=self.continuations + 1)
        return self


@dataclass(frozen=True, slots=True)
class Decision:
    step: Step
    cause: GiveUp | None = None  # with GIVE_UP


_STEPS = {step: Decision(step) for step in Step}  # decide's answers, built once (one a request otherwise)
_GIVE_UP = {cause: Decision(Step.GIVE_UP, cause) for cause in GiveUp}


def decide(leg: Leg, outcome: Outcome, budget: Budget) -> Decision:
    """The step after an attempt of ``leg`` ended in ``outcome``, with ``budget`` spent so far."""
    try:
        step = TRANSITIONS[(leg, outcome)]
    except KeyError:
        raise AttemptError(f"a {leg.value} attempt cannot end {outcome.value}") from None
    if step is GIVE_UP:
        return _GIVE_UP[GiveUp.NOT_RETRYABLE]
    if step in RETRIES and budget.retries >= budget.max_retries:
        return _GIVE_UP[GiveUp.NO_RETRY_LEFT]
    if step in CONTINUATIONS and budget.continuations >= budget.continue_limit:
        return _GIVE_UP[GiveUp.CONTINUE_LIMIT]
    return _STEPS[step]


def pair_leg(protocol: PdProtocol | None) -> Leg:
    """The first attempt of a new pair: a vllm pair's prefill leg, an sglang pair's legs together."""
    return Leg.PAIR if protocol == PdProtocol.SGLANG else Leg.PREFILL


def next_leg(step: Step, leg: Leg, protocol: PdProtocol | None) -> Leg:
    """The leg of the attempt a (non-final) step starts."""
    if step is Step.DECODE:
        return Leg.DECODE
    if step is Step.CONTINUE:
        return Leg.WHOLE
    if step in (Step.NEW_PAIR, Step.CONTINUE_ON_PAIR):
        return pair_leg(protocol)
    return leg


def attempt_id(request_id: str, number: int) -> str:
    """Attempt ``number`` of a request: the request id, then ``<request id>.<number>`` (services/proxy/events.py)."""
    return request_id if number == 0 else f"{request_id}.{number}"


def give_up_text(leg: Leg, outcome: Outcome, cause: GiveUp, continue_limit: int) -> str:
    """Why a stream the client has part of was not continued (the SSE error event that ends it)."""
    if outcome is Outcome.BROKEN:
        return f"--continue-limit {continue_limit} reached" if cause is GiveUp.CONTINUE_LIMIT else \
            "no untried node to continue on"
    if leg is Leg.PREFILL:
        return "no prefill node left for a new pair"
    return "the continuation failed and no retry was left"
