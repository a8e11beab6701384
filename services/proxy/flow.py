"""Flow control's IO (``laswrr proxy --flow-control``): holding a request the pool cannot take yet.

The rules are pure, in ``scheduler.routing.flow`` (bands, the starvation guard, DRR between
tenants in work units, bounds, TTL, Retry-After, rate limits); this module holds the aiohttp
handler on a future and wakes it:

* **Admission.** A request of a pool with nothing held goes through the normal pick at once
  (``Admitter.admit`` excludes the nodes at their slot limit). If no node can take it, or if
  requests of the pool are already held (a new one never overtakes them: the queue decides the
  order), it is held: ``FlowQueue.offer`` (429 ``queue_full`` at the bound), then the handler
  awaits its future.
* **Late binding.** ``pump(pool)`` runs whenever a slot may have freed: after every request of
  the pool ends (``released``), and every ``TICK_S`` while anything is held (a snapshot that
  raised a weight or a limit, a node back, the other replicas' requests ending). It pops held
  requests in the queue's order and admits each through the normal pick while some routable
  node is under its limit, so a held request is bound to a node only at dispatch, never to a
  draining or ejected one (they are not routable in the snapshot in force).
* **Lanes.** A request any node of its pool may take waits in the pool's queue; one for a
  model id only some nodes serve (``exclude``: the others) waits in a lane of its own, one per
  set of excluded nodes (``FlowLanes``), with the same bands, DRR, bound and TTL, and is dispatched
  only when one of *its* nodes can take it. ``pump`` takes, across the pool's lanes that have a
  node free for them, the most urgent band first. So such a request is held, not refused, while
  its nodes are full and others are free, and it never holds up requests other nodes could
  serve; 503 ``no_routable_node`` only when none of its nodes is routable for the wait.
* **Several proxies.** Each proxy holds its own queue and decides on the pool-wide view: the
  bus calls ``wake(pool)`` after every snapshot installed and every peer message taken (a slot
  another proxy freed is seen within one ``--peer-interval-ms``, not at the next snapshot), and
  ``_announce`` puts this proxy's held counts per band into its peer messages
  (``PeerChannel.note_held``); a request, held or new, waits while the other proxies hold more urgent
  requests than the pool has free slots (``_defer``).
* **Answers.** TTL run out: 429 ``queue_timeout``; no routable node in the pool for
  ``no_node_wait_s``: 503 ``no_routable_node`` (requests held then are answered, and new ones at
  once while it lasts); both with ``Retry-After`` (whole seconds, at least 1). A client that
  disconnects while held (aiohttp cancels its handler) leaves the queue at once.
* **Stopping.** A proxy told to stop (SIGTERM, ``RunningProxy.stop``) hands back what it
  holds before it drains: ``hand_back`` answers every held request 503 ``stopping`` with
  ``Retry-After: 1`` (its client sends it again, to another replica or worker), and a request
  that would be held from then on gets the same answer at once. Nothing held is dispatched by a
  stopping proxy: a request started then could be cut at the end of its grace period.
* **Never cut.** An admitted request is never held again: retries and continuations ignore the
  limits (``Admitter.admit`` with a ``tried`` set), and a handler cancelled just after its
  admission was handed over releases that admission.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from laswrr.scheduler.routing.flow import (
    FlowConfig, FlowQueue, Held, KeyLimits, RateLimits, defer_to_peers, retry_after_header,
)
from laswrr.scheduler.routing.prompt import RequestSize
from laswrr.scheduler.routing.latency import Objective
from laswrr.scheduler.routing.router import AdmitRequest, Admission, Refusal, Router
from laswrr.schemas.words import Band, HoldCause, RefusalCause
from laswrr.services.tasks import stop_task
from laswrr.services.service_metrics import Buckets

TICK_S = 0.05  # while anything is held: expiries, the no-node wait, and a pump for snapshots
WAIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True, slots=True)
class FlowAnswer:
    """The proxy's own answer to a request flow control did not dispatch."""

    status: int
    code: RefusalCause
    message: str
    retry_after: int

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


@dataclass(eq=False, slots=True)
class Waiter:
    future: asyncio.Future[Admission | FlowAnswer]
    text: bytes
    size: RequestSize | None
    exclude: frozenset[str] = frozenset()  # nodes that do not list the request's model id (routing.models)
    tokens: Sequence[int] | None = None  # its engine tokens (the exact cache view; AdmitRequest.tokens)


@dataclass
class FlowCounts:
    """What /metrics shows of flow control (``FlowCollector``)."""

    admitted: dict[tuple[str, Band, str], int] = field(default_factory=dict)  # (pool, band, how) -> n
    refused: dict[tuple[str, Band, str], int] = field(default_factory=dict)  # (pool, band, cause) -> n
    waits: dict[tuple[str, Band], Buckets] = field(default_factory=dict)  # (pool, band) -> queue wait

    def admit(self, pool: str, band: Band, how: str) -> None:
        key = (pool, band, how)
        self.admitted[key] = self.admitted.get(key, 0) + 1

    def refuse(self, pool: str, band: Band, cause: str) -> None:
        key = (pool, band, cause)
        self.refused[key] = self.refused.get(key, 0) + 1

    def waited(self, pool: str, band: Band, seconds: float) -> None:
        series = self.waits.get((pool, band))
        if series is None:
            series = self.waits[pool, band] = Buckets(WAIT_BUCKETS)
        series.observe(seconds)


class KeyRates:
    """Per-key rate limits (``RateLimits`` on the monotonic clock): charged at a request's arrival,
    settled with its real usage at its end; a key over its limit is answered a 429."""

    def __init__(self, retry_after_cap_s: float) -> None:
        self.limits = RateLimits()
        self.retry_after_cap_s = retry_after_cap_s

    def charge(self, key: str | None, limits: KeyLimits, work: int) -> FlowAnswer | None:
        """The key's rate limits at arrival: None when within them (charged), else the 429."""
        if key is None or (limits.rpm is None and limits.tpm is None):
            return None
        refused = self.limits.charge(key, limits, work, time.monotonic())
        if refused is None:
            return None
        cause, seconds = refused
        what = "requests" if cause is RefusalCause.RATE_LIMIT_REQUESTS else "tokens"
        per = limits.rpm if cause is RefusalCause.RATE_LIMIT_REQUESTS else limits.tpm
        return FlowAnswer(429, cause, f"Rate limit reached for this key: {per} {what} per minute",
                          retry_after_header(min(seconds, self.retry_after_cap_s)))

    def settle(self, key: str | None, limits: KeyLimits, charged: int, used: int | None) -> None:
        if key is not None and limits.tpm is not None and used is not None:
            self.limits.settle(key, limits, charged, used, time.monotonic())


class FlowLanes:
    """The queue's keys (module docstring, "Lanes"): one lane per pool for the requests any node
    may take (keyed by the pool's name), one per set of excluded nodes for those of a model id
    only some nodes serve, so such a request waits for its nodes without blocking the others.
    The pool-wide figures (depth, oldest wait) sum over a pool's lanes."""

    def __init__(self, queue: FlowQueue[Waiter]) -> None:
        self.queue = queue
        self.restricted: dict[str, dict[str, frozenset[str]]] = {}  # pool -> its model-restricted lanes
        self.owner: dict[str, str] = {}  # restricted lane -> its pool

    def key(self, pool: str, exclude: frozenset[str]) -> str:
        """The lane of ``pool``'s requests that may not go to ``exclude``."""
        if not exclude:
            return pool
        key = f"{pool}\x00{','.join(sorted(exclude))}"
        lanes = self.restricted.setdefault(pool, {})
        if key not in lanes:
            lanes[key] = exclude
            self.owner[key] = pool
        return key

    def of(self, pool: str) -> list[tuple[str, frozenset[str]]]:
        """``pool``'s lanes and the nodes each excludes, the pool's own first."""
        return [(pool, frozenset()), *self.restricted.get(pool, {}).items()]

    def exclude_of(self, lane: str) -> frozenset[str]:
        return self.restricted.get(self.pool_of(lane), {}).get(lane, frozenset())

    def pool_of(self, key: str) -> str:
        return self.owner.get(key, key)

    def pools(self) -> list[str]:
        """The pools that ever held a request."""
        return sorted({self.pool_of(key) for key in self.queue.pools})

    def depth(self, pool: str, band: Band | None = None) -> int:
        """Requests of ``pool`` held (in ``band``), every lane."""
        return sum(self.queue.depth(key, band) for key, _ in self.of(pool))

    def oldest_wait(self, pool: str, band: Band, now: float) -> float:
        return max(self.queue.oldest_wait(key, band, now) for key, _ in self.of(pool))


class FlowAnswers:
    """The answers flow control gives itself (module docstring, "Answers"), each counted in
    ``FlowCounts`` with the wait of a request that was held."""

    def __init__(self, queue: FlowQueue[Waiter], counts: FlowCounts, no_node_wait_s: float) -> None:
        self.queue = queue
        self.counts = counts
        self.no_node_wait_s = no_node_wait_s

    def queue_full(self, pool: str, lane: str, band: Band, now: float) -> FlowAnswer:
        self.counts.refuse(pool, band, RefusalCause.QUEUE_FULL.value)
        return FlowAnswer(429, RefusalCause.QUEUE_FULL, f"queue of pool {pool!r}, band {band.value!r} is full "
                          f"({self.queue.config.bound} requests held)", self.queue.retry_after(lane, band, now, pool))

    def no_node(self, pool: str, band: Band, exclude: frozenset[str] = frozenset()) -> FlowAnswer:
        self.counts.refuse(pool, band, RefusalCause.NO_ROUTABLE_NODE.value)
        serving = " serving its model" if exclude else ""
        return FlowAnswer(503, RefusalCause.NO_ROUTABLE_NODE,
                          f"no routable node{serving} in pool {pool!r} for {self.no_node_wait_s:g} s",
                          retry_after_header(max(1.0, self.no_node_wait_s)))

    def expired(self, pool: str, held: Held[Waiter], now: float) -> FlowAnswer:
        self.counts.refuse(pool, held.band, RefusalCause.QUEUE_TIMEOUT.value)
        self.counts.waited(pool, held.band, now - held.arrived)
        return FlowAnswer(429, RefusalCause.QUEUE_TIMEOUT, f"held {now - held.arrived:.1f} s in the queue of pool "
                          f"{pool!r} without a free slot (its time to live)",
                          self.queue.retry_after(held.pool, held.band, now, pool))

    def stopping(self, pool: str, band: Band, held: Held[Waiter] | None = None) -> FlowAnswer:
        """The proxy stops: a held request (or one that would be held) goes back to its client."""
        self.counts.refuse(pool, band, RefusalCause.STOPPING.value)
        if held is not None:
            self.counts.waited(pool, band, time.monotonic() - held.arrived)
        return FlowAnswer(503, RefusalCause.STOPPING, "proxy is shutting down: the request was not dispatched; "
                          "send it again", retry_after_header(1.0))

    def left(self, pool: str, held: Held[Waiter]) -> None:
        """A held request's client went away (nobody to answer: counted only)."""
        self.counts.refuse(pool, held.band, RefusalCause.CLIENT_DISCONNECTED)
        self.counts.waited(pool, held.band, time.monotonic() - held.arrived)


def _answer(held: Held[Waiter], answer: FlowAnswer) -> None:
    if not held.ticket.future.done():
        held.ticket.future.set_result(answer)


class FlowGate:
    """Admission with flow control, and the dispatch of held requests (module docstring)."""

    def __init__(self, router: Router, config: FlowConfig, ttl_default_s: float, ttl_max_s: float,
                 no_node_wait_s: float) -> None:
        self.router = router
        self.queue: FlowQueue[Waiter] = FlowQueue(config)
        self.lanes = FlowLanes(self.queue)
        self.rates = KeyRates(config.retry_after_cap_s)
        self.counts = FlowCounts()
        self.answers = FlowAnswers(self.queue, self.counts, no_node_wait_s)
        self.ttl_default_s, self.ttl_max_s = ttl_default_s, ttl_max_s
        self.no_node_wait_s = no_node_wait_s
        self.no_node_since: dict[str, float] = {}  # lane -> since when none of its nodes is routable
        self.deferred = 0  # dispatches left to the other proxies' more urgent held requests (``_defer``)
        self.closed = False  # the proxy stops: nothing more is held (``hand_back``)
        self._ticker: asyncio.Task[None] | None = None

    # -- admission -------------------------------------------------------------------------------

    async def admit(self, pool: str, band: Band, tenant: str, work: int, ttl: float, text: bytes,
                    size: RequestSize | None, exclude: frozenset[str] = frozenset(),
                    on_hold: Callable[[HoldCause], None] | None = None,
                    objective: Objective | None = None,
                    tokens: Sequence[int] | None = None) -> Admission | FlowAnswer | Refusal:
        """Admit now, or hold until a node can take the request (module docstring); never on a
        node in ``exclude`` (those that do not serve the request's model id). ``on_hold`` is
        called with why, once, if the request waits (``lb.req.queued``'s ``cause``). With an
        ``objective`` no node is predicted to meet even idle: its ``slo_unmeetable`` ``Refusal``
        at once; one it could meet once the queue drains is held (the caller caps its TTL at the
        TTFT target) and dispatched on the first free slot."""
        router, queue = self.router, self.queue
        now = time.monotonic()
        lane = self.lanes.key(pool, exclude)
        # a new request never overtakes held ones of its band or more urgent (the queue orders
        # them; in its lane and the pool's), nor takes a slot the other proxies' more urgent
        # held requests need
        behind = any(queue.depth(key, b) for key in {pool, lane} for b in band.at_least_as_urgent()) \
            or self._defer(pool, band)
        if not behind:
            admission = router.admitter.admit(AdmitRequest(pool, exclude, text, size, True, self._reserve(band),
                                                           objective=objective, tokens=tokens))
            if isinstance(admission, Admission):
                self.no_node_since.pop(lane, None)
                self.counts.admit(pool, band, "direct")
                return admission
            if admission.cause is RefusalCause.SLO_UNMEETABLE and not admission.saturated:
                return admission
        if self.closed:
            return self.answers.stopping(pool, band)
        if not self._routable(pool, exclude):
            since = self.no_node_since.setdefault(lane, now)
            if now - since >= self.no_node_wait_s:
                return self.answers.no_node(pool, band, exclude)
        else:
            self.no_node_since.pop(lane, None)
        waiter = Waiter(asyncio.get_running_loop().create_future(), text, size, exclude, tokens)
        held = queue.offer(lane, band, tenant, work, now, ttl, waiter, wide=not exclude)
        if isinstance(held, RefusalCause):
            return self.answers.queue_full(pool, lane, band, now)
        self.pump(pool)
        self._announce(pool)
        if waiter.future.done():
            result = waiter.future.result()
        else:
            if on_hold is not None:
                on_hold(HoldCause.NO_ROUTABLE_NODE if not self._routable(pool, exclude)
                        else HoldCause.BEHIND if behind else HoldCause.SATURATED)
            self._tick_while_held()
            try:
                result = await waiter.future
            except asyncio.CancelledError:
                self._left(held, waiter)
                raise
        if isinstance(result, Admission):
            self.counts.admit(pool, band, "held")
            self.counts.waited(pool, band, time.monotonic() - held.arrived)
        return result

    def hand_back(self) -> int:
        """The proxy stops (module docstring, "Stopping"): answer every held request 503
        ``stopping``, hold nothing from now on; how many were answered."""
        self.closed = True
        answered = 0
        for lane in list(self.queue.pools):
            pool = self.lanes.pool_of(lane)
            for held in list(self.queue.held(lane)):
                self.queue.remove(held)
                if not held.ticket.future.done():
                    _answer(held, self.answers.stopping(pool, held.band, held))
                    answered += 1
            self._announce(pool)
        return answered

    def _left(self, held: Held[Waiter], waiter: Waiter) -> None:
        """The handler was cancelled (its client went away, or the proxy is aborting)."""
        pool = self.lanes.pool_of(held.pool)
        if self.queue.remove(held):
            self.answers.left(pool, held)
            self._announce(pool)
        elif waiter.future.done() and not waiter.future.cancelled():
            result = waiter.future.result()
            if isinstance(result, Admission):  # admitted just before the cancel: give the slot back
                self.router.admitter.release(result)
                self.released(result.pool)

    def _routable(self, pool: str, exclude: frozenset[str] = frozenset()) -> bool:
        """Some routable node of ``pool`` outside ``exclude`` (one serving the request's model)."""
        return bool(self.router.table.candidates(pool, exclude))

    # -- dispatch --------------------------------------------------------------------------------

    def released(self, pool: str) -> None:
        """A request of ``pool`` ended: its slot may go to a held one."""
        self.queue.released(pool, time.monotonic())
        if self.lanes.depth(pool):
            self.pump(pool)

    def _reserve(self, band: Band) -> float:
        return 0.0 if band is Band.INTERACTIVE else self.queue.config.interactive_reserve

    def wake(self, pool: str) -> None:
        """The pool's view changed (a snapshot, a peer's message: ``BusLink.on_view``): a slot
        another proxy freed, a raised limit or a node back may let held requests go."""
        if self.lanes.depth(pool):
            self.pump(pool)

    def _defer(self, pool: str, band: Band) -> bool:
        """A request of ``band`` leaves the pool's free slots to the other proxies' more urgent
        held requests (``scheduler.routing.flow.defer_to_peers``)."""
        channel, admitter = self.router.channel, self.router.admitter
        if band is Band.INTERACTIVE or channel is None:
            return False
        peers = channel.peer_held(pool)
        if not peers:
            return False
        every = admitter.free_slots(pool)
        usable = admitter.free_slots(pool, self._reserve(band))
        if not defer_to_peers(band, peers, usable, 0 if every is None or usable is None else every - usable):
            return False
        self.deferred += 1
        return True

    def pump(self, pool: str) -> None:
        """Dispatch held requests of ``pool`` while a node can take one (module docstring): any
        band while a node is under its reserved limit, then interactive ones into the reserve;
        each lane only on its own nodes, the most urgent band first across lanes; a band the
        other proxies hold more urgent requests for waits while they need every free slot
        (``_defer``), except for the starvation guard's turn."""
        admitter, queue = self.router.admitter, self.queue
        reserve = queue.config.interactive_reserve
        moved = False
        while True:
            best: tuple[Band, bool, str, Band] | None = None
            for lane, exclude in self.lanes.of(pool):
                if not queue.depth(lane):
                    continue
                if admitter.can_take(pool, exclude, reserve=reserve):
                    upto = Band.BATCH
                elif queue.depth(lane, Band.INTERACTIVE) and admitter.can_take(pool, exclude):
                    upto = Band.INTERACTIVE
                else:
                    continue
                choice = queue.next_band(lane, upto)
                if choice is not None and (best is None or choice[0].rank < best[0].rank):
                    best = (choice[0], choice[1], lane, upto)
            if best is None:
                break
            band, guard, lane, upto = best
            if not guard and self._defer(pool, band):
                break
            held = queue.pop(lane, upto)
            assert held is not None
            moved = True
            waiter = held.ticket
            if waiter.future.done():  # cancelled with its handler
                continue
            admission = admitter.admit(AdmitRequest(pool, waiter.exclude, waiter.text, waiter.size, True,
                                                    self._reserve(held.band), tokens=waiter.tokens))
            if isinstance(admission, Refusal):  # can_take said one of its nodes could: never expected; answered, not lost
                waiter.future.set_result(self.answers.no_node(pool, held.band, waiter.exclude))
                continue
            waiter.future.set_result(admission)
        if moved:
            self._announce(pool)

    def _announce(self, pool: str) -> None:
        """This proxy's held requests of ``pool`` per band (those any node may take: the pool's
        own lane) for its next peer message (``PeerChannel.note_held``)."""
        channel, queue = self.router.channel, self.queue
        if channel is None:
            return
        now = time.monotonic()
        held: dict[Band, int] = {}
        oldest: dict[Band, int] = {}
        for band in Band:
            count = queue.wide_depth(pool, band)
            if count:
                held[band] = count
                oldest[band] = round(queue.oldest_wait(pool, band, now) * 1000)
        channel.note_held(pool, held, oldest)

    # -- while anything is held: expiries and the no-node wait --------------------------------------

    def _tick_while_held(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(self._tick(), name="proxy-flow-tick")

    async def _tick(self) -> None:
        queue, lanes, answers = self.queue, self.lanes, self.answers
        while queue.size:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            gone = queue.expire(now)
            for held in gone:
                pool = lanes.pool_of(held.pool)
                exclude = held.ticket.exclude
                _answer(held, answers.expired(pool, held, now) if self._routable(pool, exclude)
                        else answers.no_node(pool, held.band, exclude))
            touched = {lanes.pool_of(held.pool) for held in gone}
            pumped = set()
            for lane in [key for key in queue.pools if queue.depth(key)]:
                pool = lanes.pool_of(lane)
                exclude = lanes.exclude_of(lane)
                if self._routable(pool, exclude):
                    self.no_node_since.pop(lane, None)
                    pumped.add(pool)
                elif now - self.no_node_since.setdefault(lane, now) >= self.no_node_wait_s:
                    for held in list(queue.held(lane)):
                        queue.remove(held)
                        _answer(held, answers.no_node(pool, held.band, exclude))
                    touched.add(pool)
            for pool in pumped:
                self.pump(pool)
            for pool in touched - pumped:
                self._announce(pool)

    async def close(self) -> None:
        if self._ticker is not None:
            await stop_task(self._ticker)


class FlowCollector(Collector):
    """/metrics: queue depth and oldest wait per pool and band, admissions and refusals by cause,
    the queue wait histogram."""

    def __init__(self, gate: FlowGate) -> None:
        self.gate = gate

    def collect(self) -> Iterator[Metric]:
        gate, now = self.gate, time.monotonic()
        labels = ["pool", "band"]
        depth = GaugeMetricFamily("laswrr_proxy_queue_depth", "Requests held by flow control", labels=labels)
        oldest = GaugeMetricFamily("laswrr_proxy_queue_oldest_wait_seconds",
                                   "How long the oldest held request has waited", labels=labels)
        for pool in gate.lanes.pools():
            for band in Band:
                depth.add_metric([pool, band.value], gate.lanes.depth(pool, band))
                oldest.add_metric([pool, band.value], gate.lanes.oldest_wait(pool, band, now))
        admitted = CounterMetricFamily("laswrr_proxy_flow_admitted", "Requests admitted by flow control, "
                                       "directly or after being held", labels=[*labels, "how"])
        for admitted_key, n in sorted(gate.counts.admitted.items()):
            admitted.add_metric([str(label) for label in admitted_key], n)
        refused = CounterMetricFamily("laswrr_proxy_flow_refused", "Requests flow control answered itself, by cause",
                                      labels=[*labels, "cause"])
        for refused_key, n in sorted(gate.counts.refused.items()):
            refused.add_metric([str(label) for label in refused_key], n)
        waits = HistogramMetricFamily("laswrr_proxy_queue_wait_seconds",
                                      "Time held before dispatch, expiry or the client leaving", labels=labels)
        for wait_key, buckets in sorted(gate.counts.waits.items()):
            waits.add_metric([str(label) for label in wait_key], buckets.exposition(), buckets.total)
        yield from (depth, oldest, admitted, refused, waits)
