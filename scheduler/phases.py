"""Node phases and every legal transition, in one table (the h11 ``_state.py`` idea).

    active ──drain──► draining ──drained──► drained ──forget──► (removed)
      ▲  │               │ ▲                  │
      │  └──eject──► ejected ─drain─┘          │
      │                  │ uneject             │ undrain
      └──warmed── recovering ◄─────────────────┘
                     ▲  (also: draining ─undrain─►, active ─ramp─► on a large capacity rise)

* draining: admits nothing new; in-flight requests run to completion; ends at in-flight 0
  or at the drain deadline (reported as a deadline drain).
* recovering: slow start (Envoy's formula) until the window has passed, then active.
* ejected: outlier, failed probes or NPU health; no traffic unless the pool is in panic.
A trigger that has no entry for the node's phase is illegal and raises PhaseError, which the
core turns into a recorded rejection.

A node held in draining, drained or ejected remembers why (``DrainCause``, ``EjectCause``);
``RELEASES`` says which report may return it by itself: only the recovery of the cause that put
it there (capacity above 0 again, a re-registration, NPU health back, a passing probe, the
ejection time elapsed). The one other way back is the operator's ``lb.admin.undrain``, which
returns a draining or drained node whatever its drain cause (the core refuses it at capacity 0).
"""

from __future__ import annotations

from laswrr.schemas.words import DrainCause, EjectCause, Phase, RejectCause, Trigger

__all__ = ["Phase", "Trigger", "TRANSITIONS", "ROUTABLE", "LEAVING", "RECOVERING", "DRAINING", "DRAINED", "EJECTED",
           "HeldBy", "RELEASES", "PhaseError", "next_phase", "release_trigger"]


# Each phase's row: the triggers it takes and the phase each leads to; any other pair is a PhaseError.
_ROWS: dict[Phase, dict[Trigger, Phase]] = {
    Phase.ACTIVE: {Trigger.DRAIN: Phase.DRAINING, Trigger.EJECT: Phase.EJECTED, Trigger.RAMP: Phase.RECOVERING},
    Phase.RECOVERING: {Trigger.DRAIN: Phase.DRAINING, Trigger.EJECT: Phase.EJECTED, Trigger.WARMED: Phase.ACTIVE},
    Phase.DRAINING: {Trigger.DRAINED: Phase.DRAINED, Trigger.UNDRAIN: Phase.RECOVERING},
    Phase.DRAINED: {Trigger.UNDRAIN: Phase.RECOVERING, Trigger.FORGET: Phase.REMOVED},
    Phase.EJECTED: {Trigger.UNEJECT: Phase.RECOVERING, Trigger.DRAIN: Phase.DRAINING},
}
TRANSITIONS: dict[tuple[Phase, Trigger], Phase] = {
    (phase, trigger): to for phase, row in _ROWS.items() for trigger, to in row.items()}

ROUTABLE = frozenset({Phase.ACTIVE, Phase.RECOVERING})
LEAVING = frozenset({Phase.DRAINING, Phase.DRAINED})
# Phases the core compares for every node on every tick, as module constants: on CPython 3.11
# reading ``Phase.X`` goes through EnumType.__getattr__, several times the comparison's cost
# (docs/evidence/code-choices.md).
RECOVERING, DRAINING, DRAINED, EJECTED = Phase.RECOVERING, Phase.DRAINING, Phase.DRAINED, Phase.EJECTED

HeldBy = DrainCause | EjectCause
HELD_BY_KIND: dict[Phase, type[HeldBy]] = {
    Phase.DRAINING: DrainCause, Phase.DRAINED: DrainCause, Phase.EJECTED: EjectCause}

# (phase, the cause that holds the node there) -> the trigger the same cause's recovery fires.
RELEASES: dict[tuple[Phase, HeldBy], Trigger] = {
    (Phase.DRAINING, DrainCause.CAPACITY): Trigger.UNDRAIN,  # capacity set above 0 again
    (Phase.DRAINED, DrainCause.CAPACITY): Trigger.UNDRAIN,
    (Phase.DRAINING, DrainCause.REMOVE): Trigger.UNDRAIN,  # registered again before it was forgotten
    (Phase.DRAINED, DrainCause.REMOVE): Trigger.UNDRAIN,
    (Phase.DRAINING, DrainCause.NPU): Trigger.UNDRAIN,  # npu health back to OK, Warning or unreported
    (Phase.DRAINED, DrainCause.NPU): Trigger.UNDRAIN,
    (Phase.EJECTED, EjectCause.NPU): Trigger.UNEJECT,  # npu health back to OK, Warning or unreported
    (Phase.EJECTED, EjectCause.PROBE): Trigger.UNEJECT,  # a health probe passed
    (Phase.EJECTED, EjectCause.OUTLIER): Trigger.UNEJECT,  # the ejection time elapsed
}


class PhaseError(ValueError):
    """A trigger that is not legal in the node's current phase."""

    cause = RejectCause.ILLEGAL_TRANSITION


# The operator commands a rejection suggests (never the core's internal triggers: forget, eject,
# warmed, ...): drain and undrain where legal, remove and capacity always.
_COMMANDS = ((Trigger.DRAIN, "laswrr drain"), (Trigger.UNDRAIN, "laswrr undrain"))


def operator_commands(current: Phase) -> list[str]:
    return [text for trigger, text in _COMMANDS if (current, trigger) in TRANSITIONS] + [
        "laswrr remove", "laswrr capacity"]


def next_phase(current: Phase, trigger: Trigger) -> Phase:
    try:
        return TRANSITIONS[(current, trigger)]
    except KeyError:
        raise PhaseError(f"cannot {trigger.value} a node that is {current.value} (what an operator can do now: "
                         f"{', '.join(operator_commands(current))})") from None


def release_trigger(phase: Phase, held_by: str, recovered: HeldBy) -> Trigger | None:
    """The trigger that returns a node held in ``phase`` by the cause ``held_by`` once the
    source ``recovered`` reports well again; None when that report may not release it.

    A drain phase is held by a ``DrainCause``, ``ejected`` by an ``EjectCause``: the NPU's
    recovery (the same word, "npu", in both) releases only the hold of its own kind."""
    if not isinstance(recovered, HELD_BY_KIND.get(phase, ())) or recovered != held_by:
        return None
    return RELEASES.get((phase, recovered))
