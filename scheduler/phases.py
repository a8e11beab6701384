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
"""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    ACTIVE = "active"
    DRAINING = "draining"
    DRAINED = "drained"
    RECOVERING = "recovering"
    EJECTED = "ejected"
    REMOVED = "removed"


class Trigger(StrEnum):
    DRAIN = "drain"
    DRAINED = "drained"
    UNDRAIN = "undrain"
    FORGET = "forget"
    EJECT = "eject"
    UNEJECT = "uneject"
    WARMED = "warmed"
    RAMP = "ramp"


TRANSITIONS: dict[tuple[Phase, Trigger], Phase] = {
    (Phase.ACTIVE, Trigger.DRAIN): Phase.DRAINING,
    (Phase.ACTIVE, Trigger.EJECT): Phase.EJECTED,
    (Phase.ACTIVE, Trigger.RAMP): Phase.RECOVERING,
    (Phase.RECOVERING, Trigger.DRAIN): Phase.DRAINING,
    (Phase.RECOVERING, Trigger.EJECT): Phase.EJECTED,
    (Phase.RECOVERING, Trigger.WARMED): Phase.ACTIVE,
    (Phase.DRAINING, Trigger.DRAINED): Phase.DRAINED,
    (Phase.DRAINING, Trigger.UNDRAIN): Phase.RECOVERING,
    (Phase.DRAINED, Trigger.UNDRAIN): Phase.RECOVERING,
    (Phase.DRAINED, Trigger.FORGET): Phase.REMOVED,
    (Phase.EJECTED, Trigger.UNEJECT): Phase.RECOVERING,
    (Phase.EJECTED, Trigger.DRAIN): Phase.DRAINING,
}

ROUTABLE = frozenset({Phase.ACTIVE, Phase.RECOVERING})


class PhaseError(ValueError):
    """A trigger that is not legal in the node's current phase."""


def next_phase(current: Phase, trigger: Trigger) -> Phase:
    try:
        return TRANSITIONS[(current, trigger)]
    except KeyError:
        legal = sorted(t.value for (p, t) in TRANSITIONS if p == current)
        raise PhaseError(
            f"cannot {trigger.value} a node that is {current.value} (legal here: {', '.join(legal) or 'none'})"
        ) from None
