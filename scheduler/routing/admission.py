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
  request has a prompt and a size (with its engine tokens, ``tokens``, the nodes the table's
  ``KvIndex`` has an exact view of count the prompt tokens their engine holds:
  ``scheduler.routing.work``, "The exact view"); then ``policy.pick(PickContext(load, exclude,
  affinity))``. The admission of a request with ``tokens`` carries the prompt tokens the view
  predicted cached on the node picked (``cached``: the engine's count for a node with an exact
  view, else the estimate's; None without tokens or without affinity), and the exact view counts
  that prompt's blocks as held on the node until the admission is released (``KvIndex.expect``,
  "In flight").
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
from collections.abc import Collection, Container, Sequence
from dataclasses import dataclass

from laswrr.scheduler.policies import PickContext
from laswrr.scheduler.policies.affinity import Affinity
from laswrr.scheduler.routing.flow import reserved_limit
from laswrr.scheduler.routing.latency import Estimate, LatencyModel, Objective, Prediction, meets, slots_of
from laswrr.scheduler.routing.models import listed
from laswrr.scheduler.routing.kvindex import Expected, KvIndex
from laswrr.scheduler.routing.peers import PeerChannel
from laswrr.scheduler.routing.prompt import RequestSize
from laswrr.scheduler.routing.route import Picker, PoolRoute
from laswrr.scheduler.routing.table import RoutingTable
from laswrr.schemas.outputs import NodeView
from laswrr.schemas.words import NodeRole, PdProtocol, RefusalCause

_ALIKE: dict[str, float] = {}  # ``Affinity.speed`` of every pick but a measured P/D prefill pick (never written)


@dataclass(slots=True)
class AdmitRequest:
    """What ``Admitter.admit`` needs of a request (built once per pick: not frozen, whose
    ``__init__`` costs three times as much; nothing changes it after)."""

    pool: str
    tried: Collection[str] = ()  # nodes not to pick: tried already, or not serving its model id
    prompt: bytes = b""  # its text, for prefix affinity
    size: RequestSize | None = None  # its tokens
    limited: bool | None = None  # flow control's limits apply (None: for a request with nothing tried)
    reserve: float = 0.0  # the share of each limit kept for more urgent requests (flow's interactive reserve)
    role: NodeRole | None = None  # a P/D pair's decode leg: NodeRole.DECODE; else the first admission
    objective: Objective | None = None  # its latency targets (scheduler.routing.latency); None: none
    tokens: Sequence[int] | None = None  # its prompt as its engine's token ids (the exact view); None: not known


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
    cached: int | None = None  # the prompt tokens the router's view predicted cached on the node (None: unknown)
    estimate: Estimate | None = None  # with a latency model: what the node's prediction is made of (its record)
    predicted: Prediction | None = None  # the node's prediction, when the pick made one (a request with targets)
    expected: Expected | None = None  # its prompt's blocks counted as held on the node until it ends (KvIndex.expect)


Estimates = dict[str, tuple[Estimate, Prediction]]  # per node left: what its prediction is made of, and it


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why ``Admitter.admit`` bound no node."""

    cause: RefusalCause  # NO_SNAPSHOT: no snapshot for the pool; NO_ROUTABLE_NODE: no node can take it
    saturated: bool = False  # routable untried nodes exist, every one at its in-flight limit: it could wait
    # SLO_UNMEETABLE: the best prediction of the nodes left, and the targets it misses, and what it was made of
    predicted: Prediction | None = None
    objective: Objective | None = None
    estimate: Estimate | None = None


class Admitter:
    def __init__(self, table: RoutingTable, inflight_cap_per_capacity: float | None = None,
                 flow_limits: bool = False, channel: PeerChannel | None = None,
                 latency: LatencyModel | None = None, serve_late: bool = False) -> None:
        self.table = table
        self.cap_factor = inflight_cap_per_capacity
        self.flow_limits = flow_limits  # flow control: a node at its snapshot's concurrency_limit takes nothing
        self.channel = channel
        self.latency = latency  # latency objectives: the per-node estimate; None: objectives are not read
        self.serve_late = serve_late  # no node meets the objective: pick as without one (not slo_unmeetable)

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
        latency = self.latency
        estimates = None
        if latency is not None and request.objective:
            judged = self._objective(latency, picker, request, request.objective, exclude, affinity)
            if isinstance(judged, Refusal):
                return judged
            estimates = judged
        node = picker.policy.pick(PickContext(table.load.load, exclude, affinity))
        if node is None:
            return self._refusal(picker, request)
        backlog = 0
        predicted = None
        index = picker.index
        if index is not None and affinity is not None:
            if self.channel is not None and not table.kv.exact(node):  # else its engine tells every proxy itself
                self.channel.tell_prefix(route, index, node, keys)
            index.record(node, keys)
            backlog = affinity.cost_on(node) - affinity.mean  # its uncached prompt there (``_uncached``)
            if request.tokens and request.size is not None:
                predicted = request.size.prompt_tokens - backlog
        elif latency is not None and request.size is not None:
            backlog = request.size.prompt_tokens  # the estimate's queue ahead, without a prefix index
        view = picker.targets[node]
        picked: tuple[Estimate, Prediction | None] | None = estimates.get(node) if estimates is not None else None
        if picked is None and latency is not None:  # what a refold of the log needs, at no prediction's cost
            picked = self._estimate(latency, view, request.size, backlog), None  # backlog: its uncached prompt
        table.load.bind(node, backlog)
        admission = self._admission(route, picker, view, request.size, backlog)
        admission.cached = predicted
        if request.tokens:
            admission.expected = table.kv.expect(node, request.tokens)
        if picked is not None:
            admission.estimate, admission.predicted = picked
        if picker.speeds is not None and affinity is not None:
            admission.work = affinity.backlog.get(node, 0) + backlog
            if picker.speeds.rate:
                picker.speeds.drift(node, picker.targets)
        if self.channel is not None:
            self.channel.touch(pool, pick=True)
        return admission

    @staticmethod
    def _uncached(node: str, request: AdmitRequest, affinity: Affinity | None) -> int:
        """The request's prompt tokens ``node`` must prefill (all of them without affinity)."""
        if affinity is not None:
            return affinity.cost_on(node) - affinity.mean
        return request.size.prompt_tokens if request.size is not None else 0

    def _estimate(self, latency: LatencyModel, view: NodeView, size: RequestSize | None, uncached: int) -> Estimate:
        """What the prediction of ``view``'s node for a request of ``size`` with ``uncached`` prompt
        tokens to prefill there (``_uncached``) is made of, before it is bound (``Estimate``)."""
        load, node = self.table.load, view.node
        queue = load.work_of(node)
        batch = load.load.get(node, 0) + 1  # the figures are never negative: clamped all the same (once per pick)
        return Estimate(node, queue if queue > 0 else 0, uncached if uncached > 0 else 0, batch if batch > 1 else 1,
                        latency.learned(node), (size.max_tokens or 0) if size is not None else 0, slots_of(view),
                        latency.source)

    def _objective(self, latency: LatencyModel, picker: Picker, request: AdmitRequest, objective: Objective,
                   exclude: set[str], affinity: Affinity | None) -> Refusal | Estimates | None:
        """Remove from the pick the nodes predicted to miss ``objective``; each node's estimate and
        prediction (None: no target applies). When that removes every node left: the predictions
        with ``serve_late`` (pick as without an objective), else a ``SLO_UNMEETABLE`` refusal,
        ``saturated`` (hold it) while an idle node could still meet it.
        A P/D pair's legs each answer for their own target: the prefill pick for the TTFT (the
        first token follows the prefill leg), the decode pick for the TPOT; a decode pick that no
        node meets is served as without (its prefill leg is admitted already)."""
        role = picker.role
        if role is not None:
            objective = Objective(objective.ttft_ms, None) if role is NodeRole.PREFILL else \
                Objective(None, objective.tpot_ms)
            if not objective:
                return None
        targets = picker.targets
        left = [n for n in targets if n not in exclude]
        estimates: Estimates = {}
        missed: list[str] = []
        for node in left:
            estimate = self._estimate(latency, targets[node], request.size, self._uncached(node, request, affinity))
            prediction = estimate.predict(latency)
            estimates[node] = estimate, prediction
            if not meets(prediction, objective):
                missed.append(node)
        if not left or len(missed) < len(left):
            exclude.update(missed)
            return estimates
        if self.serve_late or role is NodeRole.DECODE:
            return estimates
        best = min(missed, key=lambda n: (estimates[n][1].ttft_s or 0.0, estimates[n][1].tpot_s or 0.0))
        could = any(meets(latency.predict(n, self._uncached(n, request, affinity), 1), objective) for n in left)
        estimate, prediction = estimates[best]
        return Refusal(RefusalCause.SLO_UNMEETABLE, could, prediction, objective, estimate)

    def observed(self, admission: Admission, ttft_ms: float | None, started_ms: float | None,
                 duration_ms: float | None, completion_tokens: int | None) -> None:
        """A completed attempt's recorded figures (``lb.req.finished``'s) teach its node's estimate
        (``LatencyModel.learn``), unless the estimate is shared (``LatencyModel.source``: it learns
        every proxy's attempts, this one's included, from the log's stream: ``SharedLearner``)."""
        latency, estimate = self.latency, admission.estimate
        if latency is None or latency.source or estimate is None or ttft_ms is None or started_ms is None:
            return
        latency.learn(estimate, ttft_ms, started_ms, duration_ms, completion_tokens)

    def _affinity(self, picker: Picker, request: AdmitRequest, exclude: set[str]) -> tuple[Affinity | None, list[int]]:
        scorer, index, size = self.table.scorer, picker.index, request.size
        if scorer is None or index is None or not request.prompt or size is None:
            return None, []
        keys = index.keys(request.prompt)
        eligible = [n for n in picker.targets if n not in exclude]
        speeds = picker.speeds
        speed = speeds.of(eligible) if speeds is not None and speeds.rate else _ALIKE
        load = self.table.load
        kv = self.table.kv
        cached = None
        if request.tokens and kv.nodes:
            cached = kv.cached(request.tokens, eligible)
        return scorer.score(index, keys, size, eligible, load.work_backlog(), load.load, speed, cached), keys

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
        """The admission ended: its node's in-flight, and its prompt if not prefilled yet, leave."""
        self.table.load.unbind(admission.node, admission.backlog)
        admission.backlog = 0
        if admission.expected is not None:
            KvIndex.settle(admission.expected)
            admission.expected = None
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
