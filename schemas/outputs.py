"""Outputs (stream LB_OUT, and the LB_WEIGHTS bucket for snapshots).

These are what proxies route on and what replay compares byte for byte, so they are encoded
with one fixed encoder (``schemas.codec.encode``): field order is declaration order, floats are
produced by the core already rounded, and no field depends on a clock or on dict ordering
outside the core's control.

Free text is bounded: every reason (``Rejected.reason``, ``PhaseChanged.reason``,
``NodeView.phase_reason``) and the input subject a rejection names is cut by ``clip`` to
``TEXT_MAX_CHARS`` characters, so one input carrying a megabyte of error text (a health probe's
``error``) cannot make a snapshot, a phase change or the checkpoint too large to publish.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

TEXT_MAX_CHARS = 512
"""The longest reason or named subject in an output; longer text is cut by ``clip``."""


def clip(text: str, limit: int = TEXT_MAX_CHARS) -> str:
    """``text`` when it fits, else its head and how much was cut, at most ``limit`` characters
    in all: ``"3 failed health probes: xxxx… [+999480 chars]"``."""
    if len(text) <= limit:
        return text
    head = limit - len(f"… [+{len(text)} chars]")  # the longest the tail can be
    return f"{text[:head]}… [+{len(text) - head} chars]"


class LoadView(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    queue: float
    running: float
    kv: float
    npu: float
    latency: float
    load: float
    sample_age_ms: int | None
    stale: bool
    slots: float | None = None  # believed slots after queue evidence of a silent loss; None: the capacity


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    url: str
    phase: str
    routable: bool
    capacity: int
    target_weight: float
    effective_weight: float
    inflight: int
    chip: str
    health: float
    load: LoadView
    phase_reason: str = ""


class WeightSnapshot(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One pool's routing state as of input ``as_of_seq``.

    ``proxy_inflight`` is, per proxy id, its requests the scheduler holds open on each node of
    the pool (``{proxy: {node: count}}``, proxies and nodes sorted, zero counts left out): what
    ``NodeView.inflight`` is made of. A proxy routes on ``inflight - proxy_inflight[itself] + its
    own live count`` (the pool-wide view, services/proxy/routing.py). Omitted when the pool has
    no request open, so a snapshot of such a state is byte for byte what the core emitted before
    the field existed (old logs replay exactly: replay.replay compares a snapshot recorded
    without it in that form)."""

    KIND: ClassVar[str] = "out.weight_snapshot"
    pool: str
    as_of_seq: int
    tick: int
    ts_ns: int
    panic: bool
    nodes: list[NodeView]
    proxy_inflight: dict[str, dict[str, int]] = {}


class Rejected(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One input the core did not apply. ``seq`` and ``as_of_seq`` are both the input's sequence
    number: ``as_of_seq`` names the cause as every other output does; ``seq`` stays for older
    readers. A rejection recorded before ``as_of_seq`` was added decodes with it None.

    One event of a batch (``lb.req.batch.<proxy>``) is rejected alone: ``subject`` is the
    batch's, ``event_index`` the event's position in it (absent for any other input, so a
    rejection of a single input keeps its bytes), and ``reason`` starts ``event <index> (<the
    subject it would have alone>)``."""

    KIND: ClassVar[str] = "out.rejected"
    seq: int
    subject: str
    reason: str
    as_of_seq: int | None = None
    event_index: int | None = None


class RejectedBeforeAsOfSeq(msgspec.Struct, frozen=True, kw_only=True):
    """``lb.out.rejected`` as recorded before ``as_of_seq``: replay compares such a recorded row
    with the core's rejection re-encoded in this form (``legacy_rejection``)."""

    seq: int
    subject: str
    reason: str


class PhaseChanged(msgspec.Struct, frozen=True, kw_only=True):
    KIND: ClassVar[str] = "out.phase_changed"
    node: str
    from_: str = msgspec.field(name="from")
    to: str
    as_of_seq: int
    reason: str
    pool: str = "default"
