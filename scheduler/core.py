"""The sans-IO LA-SWRR scheduler: ``Scheduler.apply(envelope) -> list[Output]``.

Theory of operation. The scheduler's state after input n is a pure function of inputs 1..n
(docs/algorithm.md §6). Each input is an ``Envelope`` (stream sequence, event time, subject, raw bytes);
``apply`` decodes it by subject, checks it against the current state, and only then mutates, so
a rejected input changes nothing and yields one ``lb.out.rejected`` output with the reason.
Time is the envelope's ``ts_ns`` (the stream's timestamp, kept monotonic); timers (drain
deadlines, slow start, ejection, proxy expiry, sample staleness) are read on ``lb.clock.tick``.
Each tick recomputes every node's target from its signals and eases the effective weight toward
it, then emits one snapshot per pool; phase changes between ticks re-target their pool and emit
its snapshot at once, so a drain (or the panic rail) is visible to proxies without waiting for
the next tick. A rejected input moves only the log position (``last_seq``, ``now_ns``).

Rules kept here: no clock, randomness, IO, logging or asyncio; dicts iterate in insertion order
and pools and nodes are emitted sorted, so two replicas given the same log emit the same bytes.

Proxy epochs. Every proxy process stamps a random ``boot_id`` on its heartbeats and request
events. The first event of a proxy id with a new boot id means the process that opened the
id's requests is gone (killed and restarted under the same ``--proxy-id``): its open requests
are voided at once, as after ``lb.proxy.stopped`` or ``proxy_timeout_ms`` of silence, and a late
event of a replaced process (its boot id is among the last ``RETIRED_BOOTS``) voids nothing. A
heartbeat with a boot id also carries the process's own in-flight count; where that is lower
than the requests the scheduler holds open for it, the oldest of them are voided (their
finished events were lost). An event without a boot id (published by hand, ``nats pub``) names
no process: it voids nothing and its heartbeat is liveness only.

``apply_guarded`` is how every driver of the core (the scheduler service, replay, what-if, the
portable replay, synthetic logs, the virtual bench) applies an input, through the one fold
(``scheduler.fold.Fold``): an exception from ``apply`` is a broken
invariant, not bad input, and becomes the recorded rejection ``internal error while applying:
<Type>: <message>`` for that input, so one poisoned message cannot wedge the stream, and a
replay reproduces the rejection at the same seq instead of crashing there.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import msgspec
from msgspec import UNSET

from laswrr.scheduler import config as config_mod
from laswrr.scheduler import reweigh
from laswrr.scheduler.phases import (DRAINED, DRAINING, EJECTED, HELD_BY_KIND, RECOVERING, ROUTABLE, HeldBy, Phase,
                                     PhaseError, Trigger, next_phase, release_trigger)
from laswrr.scheduler.state import CoreState, NodeState, OpenRequest
from laswrr.scheduler.upstreams import upstream_patterns, upstream_rejection
from laswrr.scheduler.weights import MS, concurrency_limit, fresh_ns, round_milli
from laswrr.schemas import events
from laswrr.schemas import subjects
from laswrr.schemas.codec import (CORE_STRUCTS, Envelope, Output, SchemaError, Unbatched, decode_batch, decode_event,
                                  encode)
from laswrr.schemas.outputs import (MAX_VOIDED_IDS, ConfigApplied, NodeView, PhaseChanged, Rejected, RequestsVoided,
                                   WeightSnapshot, clip)
from laswrr.schemas.words import (NPU_SEVERITY, DrainCause, EjectCause, NodeRole, NpuHealth, PdProtocol, PhaseCause,
                                  RejectCause, RequestOutcome, VoidCause)

_BATCH_PREFIX = subjects.REQ_BATCH + "."
# read for every request or every node of a tick, as module constants (see scheduler.phases)
_BOTH, _PREFILL, _COMPLETED = NodeRole.BOTH, NodeRole.PREFILL, RequestOutcome.COMPLETED
_FAILED = frozenset({RequestOutcome.UPSTREAM_ERROR, RequestOutcome.CONTINUED})
_BY_NAME = operator.attrgetter("node")
_ANSWERED = frozenset({RequestOutcome.COMPLETED, RequestOutcome.ENGINE_ERROR})
_TIMED = frozenset({DRAINING, EJECTED, RECOVERING})  # phases with a timer (_advance_timers)
_UNWEIGHED = reweigh.UNWEIGHED
_NPU_OK, _NPU_WARNING, _NPU_ALARM = NpuHealth.OK, NpuHealth.WARNING, NpuHealth.ALARM
_NPU_CRITICAL, _NPU_UNKNOWN = NpuHealth.CRITICAL, NpuHealth.UNKNOWN
_EJECT_NPU, _DRAIN_NPU, _NPU_RECOVERED = EjectCause.NPU, DrainCause.NPU, PhaseCause.NPU_RECOVERED
RETIRED_BOOTS = 4  # boot ids remembered per proxy id, so a late event of a replaced process is known



def _begin_request(node: NodeState, request: OpenRequest) -> None:
    """One more of the node's requests in flight (started, or found open when the node registers)."""
    node.inflight += 1
    if request.tokens is not None:
        node.sized_inflight += 1
        node.inflight_tokens += request.tokens


def _end_request(node: NodeState, request: OpenRequest) -> None:
    """One of the node's requests is no longer in flight (finished, or voided with its proxy)."""
    node.inflight -= 1
    if request.tokens is not None:
        node.sized_inflight -= 1
        node.inflight_tokens -= request.tokens


def _without_clock(state: CoreState) -> bytes:
    """``state`` encoded without what every tick moves: the log position, the tick, the time
    and the sample ages a snapshot shows (``Scheduler.tick_changes``)."""
    nodes = {key: node if node.load is None else
             msgspec.structs.replace(node, load=msgspec.structs.replace(node.load, sample_age_ms=None))
             for key, node in state.nodes.items()}
    return msgspec.msgpack.encode(msgspec.structs.replace(state, nodes=nodes, now_ns=0, tick=0, last_seq=0))


class Rejection(ValueError):
    """An input that is well-formed but cannot be applied to the current state; ``cause`` is
    the code its rejection records."""

    def __init__(self, message: str, cause: RejectCause) -> None:
        super().__init__(message)
        self.cause = cause


def poisoned(envelope: Envelope, exc: BaseException) -> Output:
    """The rejection recorded for an input on which the core broke an invariant."""
    reason = f"internal error while applying: {type(exc).__name__}: {exc}"
    return Output(subject=subjects.OUT_REJECTED, as_of_seq=envelope.seq,
                  data=encode(rejected(envelope, RejectCause.INTERNAL_ERROR, reason)), cause=RejectCause.INTERNAL_ERROR)


def rejected(envelope: Envelope, cause: RejectCause, reason: str, event_index: int | None = None) -> Rejected:
    """The rejection of ``envelope``; its subject and reason cut to ``TEXT_MAX_CHARS``."""
    return Rejected(as_of_seq=envelope.seq, subject=clip(envelope.subject), cause=cause, reason=clip(reason),
                    event_index=event_index)


def apply_guarded(scheduler: Scheduler, envelope: Envelope) -> tuple[list[Output], Exception | None]:
    """``(scheduler.apply(envelope), None)``; if the core raises, ``([poisoned(...)], exc)``.

    The log position still moves to ``envelope.seq`` (whatever state the handler left is kept:
    the core is deterministic, so every replica and every replay fold the same). No logging
    here: the caller reports ``exc`` when it is not None. In a batch the core catches such an
    exception per event (that event's rejection, the others still apply) and keeps the first
    in ``Scheduler.fault``, returned here.
    """
    try:
        return scheduler.apply(envelope), scheduler.fault
    except Exception as exc:  # noqa: BLE001 - a broken invariant, recorded as a rejection
        scheduler.state.last_seq = max(scheduler.state.last_seq, envelope.seq)
        return [poisoned(envelope, exc)], exc


class Scheduler:
    def __init__(self, config: config_mod.SchedulerConfig | None = None, state: CoreState | None = None) -> None:
        self.state = state or CoreState(config=config or config_mod.SchedulerConfig())
        self._outputs: list[Output] = []
        self._touched: set[str] = set()
        self._rephased: set[str] = set()
        self._seq = 0
        # node -> proxy -> open requests: ``state.open_requests`` counted (derived, never in a
        # checkpoint; rebuilt from the state here), so a snapshot's proxy_inflight costs no scan
        self._split = self._split_rebuilt()
        self.fault: Exception | None = None  # the first broken invariant in the last batch applied
        self._handlers: dict[type[events.Event], Callable[[Any, Any], None]] = {
            events.NodeRegistered: self._on_registered,
            events.NodeRemoveRequested: self._on_remove,
            events.CapacitySet: self._on_capacity,
            events.DrainRequested: self._on_drain,
            events.UndrainRequested: self._on_undrain,
            events.ConfigChanged: self._on_config,
            events.EngineSampled: self._on_engine,
            events.NpuSampled: self._on_npu,
            events.HealthProbed: self._on_health,
            events.ModelsListed: self._on_models,
            events.RequestRefused: self._on_refused,
            events.RequestQueued: self._on_queued,
            events.RequestStarted: self._on_started,
            events.RequestFinished: self._on_finished,
            events.ProxyHeartbeat: self._on_heartbeat,
            events.ProxyStopped: self._on_proxy_stopped,
            events.ClockTicked: self._on_tick,
        }
        for struct, kind in CORE_STRUCTS.items():  # a batch's events as the core decodes them
            self._handlers[struct] = self._handlers[kind]

    # -- public API ---------------------------------------------------------------------------

    @property
    def config(self) -> config_mod.SchedulerConfig:
        return self.state.config

    def apply(self, envelope: Envelope) -> list[Output]:
        state = self.state
        self._seq = state.last_seq = envelope.seq
        self._outputs = []
        self._touched = set()
        self._rephased = set()
        self.fault = None
        if envelope.ts_ns > state.now_ns:  # time never goes back
            state.now_ns = envelope.ts_ns
        try:
            if envelope.subject.startswith(_BATCH_PREFIX):
                self._apply_batch(envelope, decode_batch(envelope.subject, envelope.data, core=True)[1])
            else:
                key, event = decode_event(envelope.subject, envelope.data, core=True)
                self._handlers[type(event)](key, event)
        except (SchemaError, Rejection, PhaseError) as exc:
            return [self._output(subjects.OUT_REJECTED, rejected(envelope, exc.cause, str(exc)))]
        if self._rephased:
            self._retarget()
        if self._touched:
            for pool in sorted(self._touched):
                self._outputs.append(self._output(subjects.out_snapshot(pool), self.snapshot(pool)))
        return self._outputs

    def _retarget(self) -> None:
        """Re-target (without easing) the pools whose phases changed, that still exist."""
        for pool in sorted(self._rephased):
            if pool in self._pool_names():
                self._reweigh(pool, ease=False)

    def _apply_batch(self, envelope: Envelope, items: list[Unbatched]) -> None:
        """Each event of the batch in order, exactly as if it had arrived alone at this seq and
        time: the same handler, its pools re-targeted after it, a bad event rejected alone (its
        own outputs dropped, as a single rejected input's are). Only the snapshots differ: one
        per pool any event touched, after the whole batch, so a snapshot's ``as_of_seq`` always
        means the state after that whole input (docs/wire.md, "Batched request events")."""
        touched: set[str] = set()
        own, rephased = self._touched, self._rephased  # apply's, empty: each event's own, emptied after it
        for item in items:
            mark = len(self._outputs)
            try:
                if item.error is not None or item.event is None:
                    raise item.error or SchemaError(f"event {item.index}: nothing decoded")
                self._handlers[type(item.event)](item.key, item.event)
            except (SchemaError, Rejection, PhaseError) as exc:
                own.clear()
                rephased.clear()
                reason = str(exc) if item.error is not None else f"event {item.index} ({item.subject}): {exc}"
                self._reject_item(envelope, item.index, mark, exc.cause, reason)
                continue
            except Exception as exc:  # noqa: BLE001 - a broken invariant: this event's rejection (apply_guarded)
                own.clear()
                rephased.clear()
                self.fault = self.fault or exc
                self._reject_item(envelope, item.index, mark, RejectCause.INTERNAL_ERROR,
                                  f"event {item.index} ({item.subject}): internal error "
                                  f"while applying: {type(exc).__name__}: {exc}")
                continue
            if rephased:
                self._retarget()
                rephased.clear()
            if own:
                touched |= own
                own.clear()
        self._touched = touched

    def _reject_item(self, envelope: Envelope, index: int, mark: int, cause: RejectCause, reason: str) -> None:
        del self._outputs[mark:]
        self._outputs.append(self._output(subjects.OUT_REJECTED, rejected(envelope, cause, reason, index)))

    def snapshot(self, pool: str) -> WeightSnapshot:
        state, config = self.state, self.config
        members = sorted((n for n in state.nodes.values() if n.pool == pool), key=_BY_NAME)
        panic = reweigh.in_panic(members, config)
        # a P/D pool's roles are weighed apart (_reweigh), so each role has its own panic rail; the
        # snapshot's ``panic`` is the pool's (for a pool without roles the two are the same)
        role_panic = {role: reweigh.in_panic([n for n in members if n.role == role], config)
                      for role in {n.role for n in members}} if any(n.role != _BOTH for n in members) else {}
        factor = config.concurrency_limit_factor
        return WeightSnapshot(
            pool=pool, as_of_seq=state.last_seq, tick=state.tick, ts_ns=state.now_ns, panic=panic,
            nodes=[self._view(n, role_panic.get(n.role, panic), factor) for n in members],
            proxy_inflight=self._proxy_inflight(members),
        )

    def _proxy_inflight(self, members: list[NodeState]) -> dict[str, dict[str, int]]:
        """Per proxy, its open requests on each of ``members`` (sorted by name, as ``members`` is;
        schemas.outputs.WeightSnapshot): the split of every member's ``inflight`` by the proxy
        that started the request. O(members x proxies), from ``_split``."""
        counts: dict[str, dict[str, int]] = {}
        for node in members:
            for proxy, n in self._split.get(node.node, {}).items():
                counts.setdefault(proxy, {})[node.node] = n
        return {proxy: counts[proxy] for proxy in sorted(counts)}

    def _split_rebuilt(self) -> dict[str, dict[str, int]]:
        split: dict[str, dict[str, int]] = {}
        for request in self.state.open_requests.values():
            per_proxy = split.setdefault(request.node, {})
            per_proxy[request.proxy] = per_proxy.get(request.proxy, 0) + 1
        return split

    def _opened(self, request: OpenRequest) -> None:
        per_proxy = self._split.setdefault(request.node, {})
        per_proxy[request.proxy] = per_proxy.get(request.proxy, 0) + 1

    def _closed(self, request: OpenRequest) -> None:
        per_proxy = self._split[request.node]
        count = per_proxy[request.proxy] - 1
        if count:
            per_proxy[request.proxy] = count
        else:
            del per_proxy[request.proxy]
            if not per_proxy:
                del self._split[request.node]

    def pools(self) -> list[str]:
        return sorted(self._pool_names())

    def _pool_names(self) -> set[str]:
        return {n.pool for n in self.state.nodes.values()}

    def checkpoint(self) -> bytes:
        return msgspec.msgpack.encode(self.state)

    def tick_changes(self, now_ns: int) -> bool:
        """Whether ``lb.clock.tick`` applied at ``now_ns`` would change anything but the clock.

        False at a fixed point: no timer due (drain deadline, ejection, slow start, backoff
        decay, proxy expiry), no easing step pending, no signal still ageing or regaining; the
        tick would only move ``tick``, ``now_ns`` and the snapshots' sample ages. The tick is
        tried on a copy of the state (this state is not touched), so the answer is exactly the
        fold's. The scheduler service publishes a tick only when this is True, or as a
        keep-alive (services/scheduler_service.py); a skipped tick is not in the log, so replay
        is unaffected, and a deadline still fires at the first period after it."""
        trial = Scheduler.restore(self.checkpoint())
        tick = encode(events.ClockTicked(tick=self.state.tick + 1))
        trial.apply(Envelope(seq=self.state.last_seq + 1, ts_ns=now_ns, subject=subjects.CLOCK_TICK, data=tick))
        return _without_clock(trial.state) != _without_clock(self.state)

    def quiet_until(self, now_ns: int) -> int | None:
        """After ``tick_changes(now_ns)`` said False: the earliest event time at which a tick could
        change more than the clock if no input comes first; None: only an input can.

        A fixed point stays one while nothing a tick reads from time moves: a proxy's silence
        reaching ``proxy_timeout_ms``, a drain deadline, an outlier ejection ending, a backoff
        decay, an engine or NPU sample leaving its fresh age (``weights.fresh_ns``). While a
        slow start ramps, a slots belief regains, a sample ages between fresh and fully stale,
        or an easing step is pending, the answer is ``now_ns``: ask at every tick. A lower bound
        (a tick at that time may still change nothing: ``tick_changes`` decides), so the service
        that skips its trials before it (services/scheduler_service.py) fires every deadline at
        the same period as when it tried every tick."""
        state, cfg = self.state, self.config
        now = max(state.now_ns, now_ns)
        timeout = cfg.proxy_timeout_ms * MS
        due = [seen + timeout + 1 for seen in state.proxies.values()]  # expired once silent > timeout
        span = (cfg.stale_full_ms - cfg.stale_after_ms) * MS
        for node in state.nodes.values():
            if node.phase == RECOVERING or node.slots_seen is not None or node.effective != node.target:
                return now
            if node.phase == DRAINING:
                due.append(node.drain_deadline_ns)
            elif node.phase == EJECTED and self._releasing(node, EjectCause.OUTLIER):
                due.append(node.ejected_until_ns)
            if node.phase != EJECTED and node.ejections > 0:
                due.append(node.last_decay_ns + cfg.backoff_decay_ms * MS)
            for sampled, max_age_ms in ((node.engine_ns, node.engine_max_age_ms), (node.npu_ns, node.npu_max_age_ms)):
                if sampled is None:
                    continue  # never sampled: fully unknown, and stays so
                fresh_until = sampled + fresh_ns(cfg, max_age_ms)
                if now <= fresh_until:
                    due.append(fresh_until + 1)
                elif span and now < fresh_until + span:
                    return now  # ageing toward unknown_load
        return min(due, default=None)

    @classmethod
    def restore(cls, data: bytes) -> "Scheduler":
        return cls(state=msgspec.msgpack.decode(data, type=CoreState))

    # -- outputs ------------------------------------------------------------------------------

    def _output(self, subject: str, payload: Any) -> Output:
        index = sum(1 for output in self._outputs if output.subject == subject)
        cause = payload.cause if isinstance(payload, Rejected) else None
        return Output(subject=subject, data=encode(payload), as_of_seq=self._seq, index=index, cause=cause)

    def _view(self, node: NodeState, panic: bool, factor: float) -> NodeView:
        """The node as a snapshot shows it; ``factor``: the configuration's concurrency_limit_factor."""
        phase, capacity = node.phase, node.capacity
        routable = capacity > 0 and (phase in ROUTABLE or (panic and phase == EJECTED))  # reweigh.routable
        load = node.load or _UNWEIGHED
        slots = capacity if load.slots is None else min(load.slots, capacity)
        # positional, in NodeView's order: a msgspec Struct called with keywords matches each by name
        view = NodeView(node.node, node.url, phase, routable, capacity, node.target,
                        node.effective if routable else 0.0, node.inflight, node.chip, node.health, load,
                        node.phase_reason, node.phase_cause, concurrency_limit(slots, factor),
                        UNSET if node.models is None else list(node.models))
        if node.role == _BOTH and node.pd_protocol is None and node.bootstrap_port is None:
            return view  # set apart: a msgspec Struct called with 16 arguments or more is several times slower
        return msgspec.structs.replace(
            view, role=UNSET if node.role == _BOTH else node.role,
            pd_protocol=UNSET if node.pd_protocol is None else node.pd_protocol,
            bootstrap_port=UNSET if node.bootstrap_port is None else node.bootstrap_port)

    # -- phases -------------------------------------------------------------------------------

    def _require(self, key: str | None) -> NodeState:
        node = self.state.nodes.get(key or "")
        if node is None:
            raise Rejection(f"unknown node {key!r}: register it first (laswrr register {key} --url URL --capacity N)",
                            RejectCause.UNKNOWN_NODE)
        return node

    def _transition(self, node: NodeState, trigger: Trigger, cause: PhaseCause, reason: str,
                    floor: float = 0.0) -> None:
        new = next_phase(node.phase, trigger)
        now, reason = self.state.now_ns, clip(reason)
        self._outputs.append(self._output(subjects.out_phase(node.node), PhaseChanged(
            node=node.node, from_=node.phase, to=new, as_of_seq=self._seq, cause=cause, reason=reason,
            pool=node.pool)))
        self._touched.add(node.pool)
        self._rephased.add(node.pool)
        node.phase, node.phase_cause, node.phase_reason, node.phase_since_ns = new, cause, reason, now
        if new == Phase.REMOVED:
            self._forget(node)
        elif new in (Phase.DRAINING, Phase.DRAINED, Phase.EJECTED):
            node.effective = 0.0
            if new == Phase.DRAINING:
                node.drain_deadline_ns = now + self.config.drain_deadline_ms * MS
                node.drain_seq = self._seq
        elif new == Phase.RECOVERING:
            self._start_slow_start(node, floor)

    def _forget(self, node: NodeState) -> None:
        """Drop the node and void its open requests (a deadline drain may leave some): a late
        ``finished`` for one is then rejected instead of counting against a re-registration."""
        del self.state.nodes[node.node]
        open_requests = self.state.open_requests
        for request_id in [rid for rid, req in open_requests.items() if req.node == node.node]:
            del open_requests[request_id]
        self._split.pop(node.node, None)

    def _start_slow_start(self, node: NodeState, floor: float) -> None:
        cfg = self.config
        node.slow_start_since_ns = self.state.now_ns
        node.slow_start_floor = round_milli(min(1.0, max(cfg.slow_start_min_pct, floor)))
        start = round_milli(node.slow_start_floor * node.capacity)
        node.effective = start if node.effective <= 0 else min(node.effective, start)
        node.target = start

    def _drain(self, node: NodeState, held_by: DrainCause, cause: PhaseCause, reason: str) -> None:
        self._transition(node, Trigger.DRAIN, cause, reason)
        node.drain_cause = held_by
        self._check_drained(node)

    def _undrain(self, node: NodeState, cause: PhaseCause, reason: str) -> None:
        self._transition(node, Trigger.UNDRAIN, cause, reason)
        node.drain_cause = DrainCause.NONE
        node.remove_pending = False

    def _check_drained(self, node: NodeState) -> None:
        """Draining -> drained when no request is in flight on the node *and* every live proxy that
        says which snapshot it routes on (``ProxyHeartbeat.snapshot_seq``) routes on one from the
        drain on: its admissions from before the drain were reported before that heartbeat (one
        ordered buffer), so an in-flight count of 0 is no longer a start still in transit."""
        if node.phase == DRAINING and node.inflight == 0 and not self._unaware(node.drain_seq):
            self._transition(node, Trigger.DRAINED, PhaseCause.INFLIGHT_ZERO, "in-flight reached 0")
        if node.phase == DRAINED and node.remove_pending:
            self._transition(node, Trigger.FORGET, PhaseCause.REMOVED, "removed after drain")

    def _unaware(self, seq: int) -> bool:
        """A live proxy's last heartbeat named a snapshot older than input ``seq``."""
        return any(seen < seq for seen in self.state.proxy_seen.values())

    def _proxy_saw(self, proxy: str, seq: int | None) -> None:
        """``proxy`` routes on the snapshot as of ``seq`` now (None: forget what it said); drains
        that waited for it may end."""
        seen = self.state.proxy_seen
        if seq is None:
            if seen.pop(proxy, None) is None:
                return
        elif seq <= seen.get(proxy, -1):
            return
        else:
            seen[proxy] = seq
        for node in [n for n in self.state.nodes.values() if n.phase == Phase.DRAINING]:
            self._check_drained(node)  # a removed node is forgotten once drained: not over the dict itself

    def _eject(self, node: NodeState, held_by: EjectCause, cause: PhaseCause, reason: str, until_ns: int = 0) -> None:
        self._transition(node, Trigger.EJECT, cause, reason)
        node.eject_cause, node.ejected_until_ns = held_by, until_ns
        node.last_decay_ns = self.state.now_ns

    def _uneject(self, node: NodeState, cause: PhaseCause, reason: str) -> None:
        self._transition(node, Trigger.UNEJECT, cause, reason)
        node.eject_cause = EjectCause.NONE
        node.consecutive_failures = 0
        node.last_decay_ns = self.state.now_ns

    def _held_by(self, node: NodeState) -> str:
        """The cause holding the node in its phase ("" when none does)."""
        return node.eject_cause if node.phase == Phase.EJECTED else node.drain_cause

    def _releasing(self, node: NodeState, recovered: HeldBy) -> Trigger | None:
        return release_trigger(node.phase, self._held_by(node), recovered)

    def _release(self, node: NodeState, recovered: HeldBy, cause: PhaseCause, reason: str) -> bool:
        """Return the node from its phase if ``recovered`` is what holds it there (RELEASES)."""
        trigger = self._releasing(node, recovered)
        if trigger == Trigger.UNDRAIN:
            self._undrain(node, cause, reason)
        elif trigger == Trigger.UNEJECT:
            self._uneject(node, cause, reason)
        return trigger is not None

    # -- admin --------------------------------------------------------------------------------

    def _on_registered(self, key: str, event: events.NodeRegistered) -> None:
        allowed = upstream_patterns(self.config.allow_upstream)
        reasons = [upstream_rejection(event.url, allowed)] + [
            upstream_rejection(url, allowed, strict=False)
            for url in (event.metrics_url, event.health_url, event.status_url, event.npu_exporter) if url]
        for reason in reasons:
            if reason is not None:
                raise Rejection(reason, RejectCause.UPSTREAM_NOT_ALLOWED)
        self._check_capacity(key, event.capacity)
        self._check_disaggregation(key, event)
        node = self.state.nodes.get(key)
        if node is None:
            self._register(key, event)
            return
        if event.pool != node.pool:
            self._touched.add(node.pool)
        if (event.role, event.pd_protocol) != (node.role, node.pd_protocol):
            self._rephased.add(node.pool)  # its role's weights are now reckoned among other members
        node.url, node.chip, node.pool = event.url, event.chip, event.pool
        node.role, node.pd_protocol, node.bootstrap_port = event.role, event.pd_protocol, event.bootstrap_port
        self._touched.add(node.pool)
        if node.remove_pending:
            node.remove_pending = False
            self._release(node, DrainCause.REMOVE, PhaseCause.REGISTERED_AGAIN, "registered again")
        self._set_capacity(node, event.capacity)

    def _check_disaggregation(self, key: str, event: events.NodeRegistered) -> None:
        """A prefill or decode node names its pool's protocol, and no node of a pool names another
        protocol than its other nodes do (there is no pool entity: the pool's protocol is what its
        registrations say; docs/proxy.md, "Prefill/decode pairs")."""
        if event.role != NodeRole.BOTH and event.pd_protocol is None:
            raise Rejection(f"node {key!r} has role {event.role}: its registration must name the pool's "
                            f"pd_protocol (vllm or sglang)", RejectCause.PD_PROTOCOL)
        sglang_prefill = event.role == NodeRole.PREFILL and event.pd_protocol == PdProtocol.SGLANG
        if sglang_prefill and event.bootstrap_port is None:
            raise Rejection(f"node {key!r} is an sglang prefill node: its registration must name its bootstrap_port "
                            f"(the engine's --disaggregation-bootstrap-port)", RejectCause.PD_PROTOCOL)
        if not sglang_prefill and event.bootstrap_port is not None:
            raise Rejection(f"node {key!r} names bootstrap_port but only an sglang prefill node has one "
                            f"(role {event.role}, pd_protocol {event.pd_protocol})", RejectCause.PD_PROTOCOL)
        if event.pd_protocol is None:
            return
        for other in self.state.nodes.values():
            if other.node != key and other.pool == event.pool and other.pd_protocol not in (None, event.pd_protocol):
                raise Rejection(f"node {key!r} names pd_protocol {event.pd_protocol} but node {other.node!r} of pool "
                                f"{event.pool!r} names {other.pd_protocol}: a pool's nodes speak one protocol",
                                RejectCause.PD_PROTOCOL)

    def _register(self, key: str, event: events.NodeRegistered) -> None:
        now, cfg = self.state.now_ns, self.config
        window = cfg.slow_start_window_ms * MS
        # Slow start is useless when every node is new (Envoy, HAProxy): a cold pool starts active.
        cold = all(now - n.registered_ns < window for n in self.state.nodes.values() if n.pool == event.pool)
        node = NodeState(node=key, url=event.url, pool=event.pool, chip=event.chip, capacity=event.capacity,
                         max_capacity=event.capacity, registered_ns=now, phase_since_ns=now,
                         role=event.role, pd_protocol=event.pd_protocol, bootstrap_port=event.bootstrap_port)
        self.state.nodes[key] = node
        # requests still open on this id (started while an earlier registration of it was leaving,
        # e.g. its last request voided with its proxy just before): in flight on the new node too
        for request in self.state.open_requests.values():
            if request.node == key:
                _begin_request(node, request)
        phase = Phase.ACTIVE if cold else Phase.RECOVERING
        node.phase = phase
        self._outputs.append(self._output(subjects.out_phase(key), PhaseChanged(
            node=key, from_=Phase.NEW, to=phase, as_of_seq=self._seq, cause=PhaseCause.REGISTERED,
            reason="registered", pool=node.pool)))
        self._touched.add(node.pool)
        if cold:
            self._reweigh(node.pool, ease=False)
            node.effective = float(event.capacity)  # a new pool starts at capacity, eases to targets
        else:
            self._start_slow_start(node, 0.0)
            self._rephased.add(node.pool)

    def _set_capacity(self, node: NodeState, capacity: int) -> None:
        old = node.capacity
        if capacity == node.capacity:
            return
        node.capacity = capacity
        node.max_capacity = max(node.max_capacity, capacity)
        node.queue_evidence, node.slots_seen = 0, None  # the announced capacity replaces any belief
        self._touched.add(node.pool)
        if capacity == 0:
            if node.phase in ROUTABLE or node.phase == Phase.EJECTED:
                self._drain(node, DrainCause.CAPACITY, PhaseCause.CAPACITY_ZERO, "capacity set to 0")
            return
        if self._release(node, DrainCause.CAPACITY, PhaseCause.CAPACITY_RESTORED, f"capacity restored to {capacity}"):
            return
        if node.phase == Phase.ACTIVE and old > 0 and capacity >= old * self.config.capacity_ramp_ratio:
            self._transition(node, Trigger.RAMP, PhaseCause.CAPACITY_RAISED, f"capacity raised {old} -> {capacity}",
                             floor=node.effective / capacity)

    def _check_capacity(self, key: str, capacity: int) -> None:
        limit = self.config.max_capacity
        if capacity > limit:
            raise Rejection(f"capacity {capacity} for node {key!r} is above max_capacity {limit} (the scheduler's "
                            f"sanity limit against a typo; only for an engine that really serves more than {limit} "
                            f"requests at once, raise it: laswrr config max_capacity=N)", RejectCause.CAPACITY_ABOVE_LIMIT)

    def _on_capacity(self, key: str, event: events.CapacitySet) -> None:
        node = self._require(key)
        self._check_capacity(key, event.capacity)
        self._set_capacity(node, event.capacity)
        self._reweigh(node.pool, ease=False)

    def _on_drain(self, key: str, event: events.DrainRequested) -> None:
        self._drain(self._require(key), DrainCause.OPERATOR, PhaseCause.OPERATOR_DRAIN, "operator drain")

    def _on_undrain(self, key: str, event: events.UndrainRequested) -> None:
        node = self._require(key)
        if node.capacity == 0:
            raise Rejection(f"node {key!r} has capacity 0: give it a capacity to return it (laswrr capacity {key} N)",
                            RejectCause.CAPACITY_ZERO)
        self._undrain(node, PhaseCause.OPERATOR_UNDRAIN, "operator undrain")

    def _on_remove(self, key: str, event: events.NodeRemoveRequested) -> None:
        node = self._require(key)
        if node.phase in (Phase.DRAINING, Phase.DRAINED):
            node.remove_pending = True
            self._touched.add(node.pool)
            self._check_drained(node)
            return
        self._transition(node, Trigger.DRAIN, PhaseCause.REMOVE_REQUESTED, "remove requested")
        node.drain_cause, node.remove_pending = DrainCause.REMOVE, True
        self._check_drained(node)

    def _on_config(self, key: None, event: events.ConfigChanged) -> None:
        self.state.config = config_mod.with_changes(self.config, dict(event.set))
        self._outputs.append(self._output(subjects.OUT_CONFIG, ConfigApplied(
            as_of_seq=self._seq, set=dict(event.set), config=msgspec.structs.asdict(self.state.config))))

    # -- samples ------------------------------------------------------------------------------

    def _on_engine(self, key: str, event: events.EngineSampled) -> None:
        node = self._require(key)
        node.running, node.waiting, node.kv = event.running, event.waiting, event.kv_cache_usage
        node.engine_ns, node.engine_max_age_ms = self.state.now_ns, event.max_age_ms
        node.free_slots, node.free_blocks, node.total_blocks = event.free_slots, event.free_blocks, event.total_blocks
        blocks = reweigh.block_usage(event.free_blocks, event.total_blocks)
        node.kv = event.kv_cache_usage if blocks is None else blocks  # the engine's KV blocks over a derived %
        if event.free_slots is not None:  # the engine says its free slots: believed at once
            reweigh.observe_free_slots(node, event.running, event.free_slots, self.state.now_ns)
        else:
            reweigh.observe_slots(node, event.running, event.waiting, self.state.now_ns, self.config)
        if event.ttft_ms is not None:
            reweigh.observe_latency(node, event.ttft_ms, self.config)

    def _on_npu(self, key: str, event: events.NpuSampled) -> None:
        node = self._require(key)
        utils = [c.aicore_util for c in event.chips if c.aicore_util is not None]
        node.npu_util = round_milli(sum(utils) / len(utils)) if utils else None
        node.npu_ns = self.state.now_ns
        node.npu_max_age_ms = event.max_age_ms
        states = [NpuHealth.of(c.health) for c in event.chips if c.health]
        worst = max(states, key=NPU_SEVERITY.__getitem__) if states else None
        node.npu_health = worst
        if worst is None or worst is _NPU_OK or worst is _NPU_WARNING:
            if node.phase in HELD_BY_KIND:  # only a node held in a phase can be released from it
                reason = f"npu health back to {worst or 'unreported'}"
                if not self._release(node, _EJECT_NPU, _NPU_RECOVERED, reason):
                    self._release(node, _DRAIN_NPU, _NPU_RECOVERED, reason)
            return
        if node.phase not in ROUTABLE:
            return
        cause = next((f": npu {c.npu_id} chip {c.chip_id} {c.fault}" for c in event.chips
                      if c.fault and NpuHealth.of(c.health) == worst), "")
        if worst is _NPU_CRITICAL or worst is _NPU_UNKNOWN:
            self._eject(node, _EJECT_NPU, PhaseCause.NPU_UNHEALTHY, f"npu health {worst}{cause}")
        elif worst is _NPU_ALARM:
            self._drain(node, _DRAIN_NPU, PhaseCause.NPU_ALARM, f"npu health {worst}{cause}")

    def _on_health(self, key: str, event: events.HealthProbed) -> None:
        node = self._require(key)
        if event.ok:
            node.probe_failures = 0
            self._release(node, EjectCause.PROBE, PhaseCause.PROBE_PASSED, "health probe passed")
            return
        node.probe_failures += 1
        if node.probe_failures >= self.config.health_fail_threshold and node.phase in ROUTABLE:
            detail = f": {event.error}" if event.error else ""
            self._eject(node, EjectCause.PROBE, PhaseCause.PROBE_FAILED, f"{node.probe_failures} failed health probes{detail}")

    # -- requests -----------------------------------------------------------------------------

    def _on_models(self, key: str, event: events.ModelsListed) -> None:
        """The engine's model ids: a change goes out in the pool's snapshot (the proxies route
        model ids on it); the same list again changes nothing and emits nothing."""
        node = self._require(key)
        if node.models != event.models:
            node.models = list(event.models)
            self._touched.add(node.pool)

    def _on_refused(self, key: str, event: events.RequestRefused) -> None:
        """A request the proxy answered itself: no node was involved, so nothing here changes;
        the event is in the log for the views and the report (docs/wire.md)."""

    def _on_queued(self, key: str, event: events.RequestQueued) -> None:
        """A request held by flow control: no node yet, nothing changes (its wait is for the views)."""

    def _on_started(self, key: str, event: events.RequestStarted) -> None:
        node = self._require(key)
        if event.request_id in self.state.open_requests:
            raise Rejection(f"duplicate request_id {event.request_id!r}: already in flight",
                            RejectCause.DUPLICATE_REQUEST)
        self._proxy_epoch(event.proxy, event.boot_id)
        # what the leg holds on its node: a prefill leg its prompt (the prefill work waiting there:
        # its role is weighed on it, reweigh.occupancy), any other request its prompt and output
        tokens = None if event.prompt_tokens is None else \
            event.prompt_tokens + (0 if event.role == _PREFILL else event.max_tokens or 0)
        request = OpenRequest(node=key, proxy=event.proxy, boot=event.boot_id, tokens=tokens)
        self.state.open_requests[event.request_id] = request
        self._opened(request)
        self.state.proxies[event.proxy] = self.state.now_ns
        _begin_request(node, request)

    def _on_finished(self, key: str, event: events.RequestFinished) -> None:
        if event.request_id not in self.state.open_requests:
            raise Rejection(f"unknown request_id {event.request_id!r}: never started, already finished, or expired",
                            RejectCause.UNKNOWN_REQUEST)
        self._proxy_epoch(event.proxy, event.boot_id)
        request = self.state.open_requests.pop(event.request_id, None)
        if request is None:  # voided just now: its proxy process was replaced
            return
        self._closed(request)
        self.state.proxies[event.proxy] = self.state.now_ns
        node = self.state.nodes.get(request.node)
        if node is None:
            return
        _end_request(node, request)
        ttft = event.first_token_ms  # an answer not streamed has no time to first token (its whole answer came at once)
        if ttft is not None and event.outcome == _COMPLETED:
            reweigh.observe_latency(node, ttft, self.config)
        if event.outcome in _FAILED:  # continued: broke mid-stream
            node.consecutive_failures += 1
            if node.consecutive_failures >= self.config.consecutive_failures and node.phase in ROUTABLE:
                self._outlier_eject(node)
        elif event.outcome in _ANSWERED:
            # a 4xx is an answer: the engine is up (docs/wire.md, "Engine errors and the router's own answers")
            node.consecutive_failures = 0
        self._check_drained(node)

    def _outlier_eject(self, node: NodeState) -> None:
        """Envoy consecutive-error ejection with growing time and the max-ejected rail."""
        cfg = self.config
        members = [n for n in self.state.nodes.values() if n.pool == node.pool]
        ejected = sum(1 for n in members if n.phase == Phase.EJECTED)
        allowed = max(1, int(cfg.max_ejection_percent * len(members) // 100))
        if ejected >= allowed:
            return
        if cfg.base_ejection_ms * node.ejections < cfg.max_ejection_ms + cfg.base_ejection_ms:
            node.ejections += 1
        duration_ms = min(cfg.base_ejection_ms * node.ejections, max(cfg.max_ejection_ms, cfg.base_ejection_ms))
        failures = node.consecutive_failures
        node.consecutive_failures = 0
        self._eject(node, EjectCause.OUTLIER, PhaseCause.UPSTREAM_ERRORS,
                    f"{failures} consecutive upstream errors; ejected for {duration_ms / 1000:g} s",
                    until_ns=self.state.now_ns + duration_ms * MS)

    def _on_heartbeat(self, key: str, event: events.ProxyHeartbeat) -> None:
        self.state.proxies[key] = self.state.now_ns
        if not self._proxy_epoch(key, event.boot_id):  # no boot id (published by hand): liveness only
            return
        mine = [rid for rid, req in self.state.open_requests.items() if req.proxy == key]
        if event.inflight < len(mine):  # the proxy knows better: the oldest are phantoms (lost finished)
            self._void(mine[:len(mine) - event.inflight], key, VoidCause.FINISH_LOST)
        self._proxy_saw(key, event.snapshot_seq)

    def _on_proxy_stopped(self, key: str, event: events.ProxyStopped) -> None:
        self._expire_proxy(key, VoidCause.PROXY_STOPPED)

    def _proxy_epoch(self, proxy: str, boot: str | None) -> bool:
        """Follow the proxy process behind ``proxy`` (module header: proxy epochs). A new boot
        id voids the requests that another process of this id left open; a boot id this id
        already replaced (a late event of a dead process) changes nothing. True when ``boot``
        is the id's live process."""
        if boot is None:
            return False
        state = self.state
        current = state.proxy_boots.get(proxy)
        if current == boot:
            return True
        retired = state.retired_boots.get(proxy, [])
        if boot in retired:
            return False
        if current is not None:
            state.retired_boots[proxy] = [*retired, current][-RETIRED_BOOTS:]
        state.proxy_boots[proxy] = boot
        self._proxy_saw(proxy, None)  # what the replaced process saw is not this one's
        self._void([rid for rid, req in state.open_requests.items() if req.proxy == proxy and req.boot != boot],
                   proxy, VoidCause.PROXY_REPLACED, boot)
        return True

    def _expire_proxy(self, proxy: str, cause: VoidCause) -> None:
        """Void a dead proxy's open requests (docs/algorithm.md §4, "Phantom in-flight")."""
        self.state.proxies.pop(proxy, None)
        self.state.proxy_boots.pop(proxy, None)
        self.state.retired_boots.pop(proxy, None)
        self._void([rid for rid, req in self.state.open_requests.items() if req.proxy == proxy], proxy, cause)
        self._proxy_saw(proxy, None)

    def _void(self, request_ids: list[str], proxy: str, cause: VoidCause, boot: str | None = None) -> None:
        """Stop counting ``request_ids`` (of ``proxy``), and say so: ``lb.out.voided.<proxy>``, the
        recorded fact the views count interruptions by (a proxy id is one subject token: ``events.Name``)."""
        for start in range(0, len(request_ids), MAX_VOIDED_IDS):
            self._outputs.append(self._output(subjects.out_voided(proxy), RequestsVoided(
                as_of_seq=self._seq, proxy=proxy, cause=cause, request_ids=request_ids[start:start + MAX_VOIDED_IDS],
                boot_id=boot)))
        open_requests = self.state.open_requests
        for request_id in request_ids:
            request = open_requests.pop(request_id)
            self._closed(request)
            node = self.state.nodes.get(request.node)
            if node is not None:
                _end_request(node, request)
                self._touched.add(node.pool)
                self._check_drained(node)

    # -- time ---------------------------------------------------------------------------------

    def _on_tick(self, key: None, event: events.ClockTicked) -> None:
        state, cfg = self.state, self.config
        state.tick = max(state.tick, event.tick)
        timeout = cfg.proxy_timeout_ms * MS
        for proxy in [p for p, seen in state.proxies.items() if state.now_ns - seen > timeout]:
            self._expire_proxy(proxy, VoidCause.PROXY_SILENT)
        for node in list(state.nodes.values()):
            if node.ejections or node.phase in _TIMED:  # else no timer runs for it
                self._advance_timers(node, state.now_ns, cfg)
        by_pool: dict[str, list[NodeState]] = {}
        for node in state.nodes.values():
            by_pool.setdefault(node.pool, []).append(node)
        for pool in sorted(by_pool):
            self._reweigh(pool, members=by_pool[pool])
            self._touched.add(pool)

    def _advance_timers(self, node: NodeState, now: int, cfg: config_mod.SchedulerConfig) -> None:
        if node.phase == DRAINING and now >= node.drain_deadline_ns:
            self._transition(node, Trigger.DRAINED, PhaseCause.DRAIN_DEADLINE,
                             f"drain deadline reached with {node.inflight} in flight")
            self._check_drained(node)
        elif node.phase == EJECTED and self._releasing(node, EjectCause.OUTLIER) and now >= node.ejected_until_ns:
            self._release(node, EjectCause.OUTLIER, PhaseCause.EJECTION_ELAPSED, "ejection time elapsed")
        elif node.phase == RECOVERING and now - node.slow_start_since_ns >= cfg.slow_start_window_ms * MS:
            self._transition(node, Trigger.WARMED, PhaseCause.SLOW_START_ELAPSED, "slow start window elapsed")
        if node.phase != EJECTED and node.ejections > 0 and now - node.last_decay_ns >= cfg.backoff_decay_ms * MS:
            node.ejections -= 1
            node.last_decay_ns = now

    def _reweigh(self, pool: str, ease: bool = True, members: list[NodeState] | None = None) -> None:
        """Recompute the pool's targets from the signals (scheduler.reweigh); on a tick also ease
        effective weights one step."""
        if members is None:
            members = [n for n in self.state.nodes.values() if n.pool == pool]
        by_role: dict[NodeRole, list[NodeState]] = {}
        for node in members:  # a P/D pool's prefill and decode nodes are weighed each among their role
            by_role.setdefault(node.role, []).append(node)
        for group in by_role.values():
            reweigh.reweigh_pool(group, self.state.now_ns, self.config, ease)
