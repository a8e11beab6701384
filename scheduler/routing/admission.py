"""Admission: bind a request to one node of its pool, or say why not (``Admitter.admit``).

* **One call, one typed answer.** ``admit(AdmitRequest)`` returns an ``Admission`` (the node,
  counted in flight) or a ``Refusal`` (its ``cause``, a ``schemas.words.RefusalCause``, and
  ``saturated``: routable untried nodes exist, every one at its limit, a request that could
  wait where the others could not).
* **The steps, for every request and every policy.** The pool's picker for the request's role
  (``scheduler.routing.route``); the excluded nodes: tried for this request (nginx's per-request
  ``tried`` set) and, with a cap, the nodes whose estimated in-flight reached ``ceil(F x
  capacity)`` and, with flow control (``flow_limits``), the nodes at the slot limit their
  snapshot publishes (``NodeView.concurrency_limit``; not for a retry or a continuation, whose
  request was admitted already, nor for a role that is never held: flow control never cuts
  one); the request's ``Affinity`` from the scorer, when the picker's role has an index and the
  request has a prompt and a size; then ``policy.pick(PickContext(load, exclude, affinity))``.
* **Admission binds.** The ``Admission`` holds the node's URL from the snapshot in force *at
  admission*; later snapshots (weight change, drain, capacity 0, removal) never touch it; only
  ``release`` ends it. ``prefilled`` takes its prompt out of the node's prefill backlog when the
  engine's first byte arrives (``release`` at the latest); ``prefill_done`` reports a P/D prefill
  leg's time (``scheduler.routing.work.PrefillSpeeds``).
* **Flow control's questions** (``services/proxy/flow.py``): ``can_take`` (some node of the pool
  under its limits: a held request may go) and ``free_slots``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Container
from dataclasses import dataclass

from laswrr.scheduler.policies import PickContext
from laswrr.scheduler.policies.affinity import Affinity
from laswrr.scheduler.routing.flow import reserved_limit
from laswrr.scheduler.routing.models import listed
from laswrr.scheduler.routing.peers import PeerChannel
from laswrr.scheduler.routing.prompt import RequestSize
from laswrr.scheduler.routing.route import Picker, PoolRoute
from laswrr.scheduler.routing.table import RoutingTable
from laswrr.schemas.outputs import NodeView
from laswrr.schemas.words import NodeRole, PdProtocol, RefusalCause

_ALIKE: dict[str, float] = {}  # ``Affinity.speed`` of every pick but a measured P/D prefill pick (never written)


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    """What ``Admitter.admit`` needs of a request."""

    pool: str
    tried: Collection[str] = ()  # nodes not to pick: tried already, or not serving its model id
    prompt: bytes = b""  # its text, for prefix affinity
    size: RequestSize | None = None  # its tokens
    limited: bool | None = None  # flow control's limits apply (None: for a request with nothing tried)
    reserve: float = 0.0  # the share of each limit kept for more urgent requests (flow's interactive reserve)
    role: NodeRole | None = None  # a P/D pair's decode leg: NodeRole.DECODE; else the first admission


@dataclass(slots=True, eq=False)
class Admission:
    """A request bound to one node: everything the forwarder needs, fixed at admission."""

    pool: str
    node: str
    url: str
    snapshot_seq: int
    size: RequestSize | None = None  # the request's tokens, as the proxy estimates them
    backlog: int = 0  # its uncached prompt estimate, in the node's prefill backlog until prefilled
    models: list[str] | None = None  # the model ids the node listed (NodeView.models); None: never listed
    role: NodeRole | None = None  # a P/D pool's leg: prefill (the first admission) or decode; None: whole
    protocol: PdProtocol | None = None  # a P/D pool's protocol (with ``role``)
    bootstrap_port: int | None = None  # an sglang prefill node's bootstrap server port (its registration's)
    work: int = 0  # a prefill leg's: its node's prefill backlog at the pick plus its own (``prefill_done``)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why ``Admitter.admit`` bound no node."""

    cause: RefusalCause  # NO_SNAPSHOT: no snapshot for the pool; NO_ROUTABLE_NODE: no node can take it
    saturated: bool = False  # routable untried nodes exist, every one at its in-flight limit: it could wait


class Admitter:
    def __init__(self, table: RoutingTable, inflight_cap_per_capacity: float | None = None,
                 flow_limits: bool = False, channel: PeerChannel | None = None) -> None:
        self.table = table
        self.cap_factor = inflight_cap_per_capacity
        self.flow_limits = flow_limits  # flow control: a node at its snapshot's concurrency_limit takes nothing
        self.channel = channel

    def admit(self, request: AdmitRequest) -> Admission | Refusal:
        """Pick a node for ``request`` (module docstring)."""
        table, pool = self.table, request.pool
        route = table.route(pool)
        if route is None:
            return Refusal(RefusalCause.NO_SNAPSHOT)
        picker = route.picker(request.role)
        if not picker.targets:
            return Refusal(RefusalCause.NO_ROUTABLE_NODE)
        exclude = set(request.tried)
        flow = self.flow_limits and picker.limited and (not exclude if request.limited is None else request.limited)
        if self.cap_factor is not None or flow:
            exclude.update(n for n, view in picker.targets.items() if self.at_limit(view, flow, request.reserve))
        affinity, keys = self._affinity(picker, request, exclude)
        node = picker.policy.pick(PickContext(table.load.load, exclude, affinity))
        if node is None:
            return self._refusal(picker, request)
        backlog = 0
        index = picker.index
        if index is not None and affinity is not None:
            if self.channel is not None:
                self.channel.tell_prefix(route, index, node, keys)
            index.record(node, keys)
            backlog = affinity.cost_on(node) - affinity.mean  # its uncached prompt there
        table.load.bind(node, backlog)
        view = picker.targets[node]
        admission = self._admission(route, picker, view, request.size, backlog)
        if picker.speeds is not None and affinity is not None:
            admission.work = affinity.backlog.get(node, 0) + backlog
            if picker.speeds.rate:
                picker.speeds.drift(node, picker.targets)
        if self.channel is not None:
            self.channel.touch(pool, pick=True)
        return admission

    def _affinity(self, picker: Picker, request: AdmitRequest, exclude: set[str]) -> tuple[Affinity | None, list[int]]:
        scorer, index, size = self.table.scorer, picker.index, request.size
        if scorer is None or index is None or not request.prompt or size is None:
            return None, []
        keys = index.keys(request.prompt)
        eligible = [n for n in picker.targets if n not in exclude]
        speeds = picker.speeds
        speed = speeds.of(eligible) if speeds is not None and speeds.rate else _ALIKE
        load = self.table.load
        return scorer.score(index, keys, size, eligible, load.work_backlog(), load.load, speed), keys

    @staticmethod
    def _admission(route: PoolRoute, picker: Picker, view: NodeView, size: RequestSize | None,
                   backlog: int) -> Admission:
        seq = route.snapshot.as_of_seq
        if route.pd_protocol is None:  # a whole request (built positionally: once per request)
            return Admission(route.snapshot.pool, view.node, view.url, seq, size, backlog, listed(view))
        port = view.bootstrap_port if isinstance(view.bootstrap_port, int) else None
        return Admission(route.snapshot.pool, view.node, view.url, seq, size, backlog, listed(view), picker.role,
                         route.pd_protocol, port)

    def _refusal(self, picker: Picker, request: AdmitRequest) -> Refusal:
        done = set(request.tried)
        untried = [view for node, view in picker.targets.items() if node not in done]
        flow = self.flow_limits and picker.limited and not done
        saturated = bool(untried) and all(self.at_limit(view, flow) for view in untried)
        return Refusal(RefusalCause.NO_ROUTABLE_NODE, saturated)

    def release(self, admission: Admission) -> None:
        self.prefilled(admission)
        self.table.load.unbind(admission.node)
        if self.channel is not None:
            self.channel.touch(admission.pool)

    def prefilled(self, admission: Admission) -> None:
        """The engine sent the admission's first byte: its prompt has left the node's prefill backlog."""
        if admission.backlog:
            self.table.load.prefilled(admission.node, admission.backlog)
            admission.backlog = 0
            if self.channel is not None:
                self.channel.touch(admission.pool)

    def prefill_done(self, admission: Admission, seconds: float) -> None:
        """A P/D pair's prefill leg answered ``seconds`` after it was sent: its node's rate, the
        prefill work it had at the pick (``Admission.work``) over that time (``PrefillSpeeds.done``)."""
        if admission.role == NodeRole.PREFILL:
            self.table.speeds.done(admission.node, admission.work, seconds)

    def at_limit(self, view: NodeView, flow: bool = True, reserve: float = 0.0) -> bool:
        """The node can take no request now: at ``--inflight-cap-per-capacity``'s cap, or, with
        flow control (``flow``: a new request, not a retry), at the slot limit the snapshot
        publishes (``NodeView.concurrency_limit``, 0: none), both on the pool-wide estimate ``load``."""
        load = self.table.load.load.get(view.node, 0)
        if self.cap_factor is not None and load >= math.ceil(self.cap_factor * view.capacity):
            return True
        if not (flow and self.flow_limits and view.concurrency_limit > 0):
            return False
        return reserved_limit(view.concurrency_limit, reserve) <= load

    def can_take(self, pool: str, exclude: Container[str] = (), reserve: float = 0.0) -> bool:
        """Some routable node of ``pool`` not in ``exclude`` is under its limits (less ``reserve``):
        a held request may be dispatched."""
        route = self.table.route(pool)
        return route is not None and any(not self.at_limit(view, True, reserve)
                                         for node, view in route.first.targets.items() if node not in exclude)

    def free_slots(self, pool: str, reserve: float = 0.0) -> int | None:
        """The pool's free slots: the sum over its routable nodes of their slot limit (less
        ``reserve``: ``flow.reserved_limit``) less the pool-wide ``load`` (none below 0); None when
        some node publishes no limit (unlimited)."""
        route = self.table.route(pool)
        if route is None:
            return 0
        free = 0
        load = self.table.load.load
        for node, view in route.first.targets.items():
            if view.concurrency_limit <= 0:
                return None
            free += max(0, reserved_limit(view.concurrency_limit, reserve) - load.get(node, 0))
        return free
