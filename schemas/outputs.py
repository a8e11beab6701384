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
from msgspec import UNSET, UnsetType

from laswrr.schemas.words import NodeRole, PdProtocol, Phase, PhaseCause, RejectCause, VoidCause

TEXT_MAX_CHARS = 512
"""The longest reason or named subject in an output; longer text is cut by ``clip``."""


def clip(text: str, limit: int = TEXT_MAX_CHARS) -> str:
    """``text`` when it fits, else its head and how much was cut, at most ``limit`` characters
    in all: ``"3 failed health probes: xxxx… [+999480 chars]"``."""
    if len(text) <= limit:
        return text
    head = limit - len(f"… [+{len(text)} chars]")  # the longest the tail can be
    return f"{text[:head]}… [+{len(text) - head} chars]"


class LoadSignals(msgspec.Struct, frozen=True):
    """A node's five load signals, each 0..1, and ``load``, their weighted mean (docs/algorithm.md §1),
    rounded in a snapshot's ``LoadView``."""

    queue: float
    running: float
    kv: float
    npu: float
    latency: float
    load: float


class LoadView(LoadSignals, frozen=True, kw_only=True, omit_defaults=True):
    sample_age_ms: int | None
    stale: bool
    slots: float | None = None  # believed slots after queue evidence of a silent loss; None: the capacity
    free_slots: int | None = None  # the engine's own free slots (MindIE status); None: not reported
    free_blocks: int | None = None  # the engine's own free KV blocks; None: not reported


class NodeView(msgspec.Struct, frozen=True):
    """A node as a snapshot shows it (the core builds it with positional arguments, in this order)."""

    node: str
    url: str
    phase: Phase
    routable: bool
    capacity: int
    target_weight: float
    effective_weight: float
    inflight: int
    chip: str
    health: float
    load: LoadView
    phase_reason: str = ""  # for people; phase_cause for machines
    phase_cause: PhaseCause = PhaseCause.REGISTERED
    # The slot limit (scheduler.routing.flow.concurrency_limit): the pool-wide in-flight count
    # under which the node can take one more request; a proxy with flow control holds requests
    # beyond it. 0: no limit published.
    concurrency_limit: int = 0
    # The model ids the node's engine lists (lb.metrics.models), in its order; absent (UNSET) until
    # the collector has listed them.
    models: list[str] | UnsetType = UNSET
    # Prefill/decode disaggregation: the node's role and its pool's protocol, absent (UNSET) for a
    # ``both`` node without a protocol, so a pool without roles keeps its snapshot bytes.
    role: NodeRole | UnsetType = UNSET
    pd_protocol: PdProtocol | UnsetType = UNSET
    bootstrap_port: int | UnsetType = UNSET  # an sglang prefill node's bootstrap server port


class WeightSnapshot(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One pool's routing state as of input ``as_of_seq``.

    ``proxy_inflight`` is, per proxy id, its requests the scheduler holds open on each node of
    the pool (``{proxy: {node: count}}``, proxies and nodes sorted, zero counts left out): what
    ``NodeView.inflight`` is made of. A proxy routes on ``inflight - proxy_inflight[itself] + its
    own live count`` (the pool-wide view, scheduler/routing/load.py). Omitted when the pool has
    no request open."""

    KIND: ClassVar[str] = "out.weight_snapshot"
    pool: str
    as_of_seq: int
    tick: int
    ts_ns: int
    panic: bool
    nodes: list[NodeView]
    proxy_inflight: dict[str, dict[str, int]] = {}


class Rejected(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One input the core did not apply: ``as_of_seq`` is the input's sequence number, ``cause``
    the code machines read (metrics, views, replay), ``reason`` the text for people.

    One event of a batch (``lb.req.batch.<proxy>``) is rejected alone: ``subject`` is the
    batch's, ``event_index`` the event's position in it (absent for any other input), and
    ``reason`` starts ``event <index> (<the subject it would have alone>)``. An output too large
    to publish is replaced by a rejection of its input with cause ``unpublishable_output`` and
    ``limit`` the payload limit it was over (``schemas.codec.publishable``; replay redoes the
    replacement with it)."""

    KIND: ClassVar[str] = "out.rejected"
    as_of_seq: int
    subject: str
    cause: RejectCause
    reason: str
    event_index: int | None = None
    limit: int | None = None


class ConfigApplied(msgspec.Struct, frozen=True, kw_only=True):
    """``lb.out.config``: an ``lb.admin.config`` was applied (an invalid one is an
    ``lb.out.rejected``, so every admin command gets a verdict). ``set`` is what the input set,
    ``config`` every key of the configuration in force after it, in declaration order."""

    KIND: ClassVar[str] = "out.config_applied"
    as_of_seq: int
    set: dict[str, float | int | bool | str]
    config: dict[str, float | int | bool | str]


class PhaseChanged(msgspec.Struct, frozen=True, kw_only=True):
    KIND: ClassVar[str] = "out.phase_changed"
    node: str
    from_: Phase = msgspec.field(name="from")
    to: Phase
    as_of_seq: int
    cause: PhaseCause
    reason: str
    pool: str = "default"


MAX_VOIDED_IDS = 1000  # request ids in one RequestsVoided (more: several outputs, ``index`` 1, 2, ...)


class RequestsVoided(msgspec.Struct, frozen=True, kw_only=True):
    """``lb.out.voided.<proxy>``: the scheduler stopped counting requests that ``proxy`` had open,
    at input ``as_of_seq``, because of ``cause`` (schemas.words.VoidCause): its stop, its silence
    for ``proxy_timeout_ms``, a new process of the same proxy id (``boot_id``: the one that
    replaced the process that opened them), or its heartbeat counting fewer in flight.
    ``request_ids`` are the attempt ids (``lb.req.started``'s ``request_id``), in the order they
    were opened, at most ``MAX_VOIDED_IDS`` per message. The recorded fact the views read: a
    request voided with its proxy gone (``proxy_silent``, ``proxy_replaced``) and no finished
    event is an interruption (docs/analysts.md), and replay reproduces it byte for byte."""

    KIND: ClassVar[str] = "out.requests_voided"
    as_of_seq: int
    proxy: str
    cause: VoidCause
    request_ids: list[str]
    boot_id: str | None = None
