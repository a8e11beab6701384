"""Flow control, pure: what a proxy holds when the fleet cannot take a request yet, and in what order it lets it go.

The proxy (``services/proxy/flow.py``) holds the aiohttp request and wakes on releases and
snapshots; everything it decides is here, with time passed in (``now``, monotonic seconds), so
the order is deterministic and unit-tested (tests/scheduler/test_flow.py).

Rules (docs/proxy.md, "Flow control"):

* **Saturation: the slot limit.** A node can take a request while its pool-wide in-flight
  estimate (``scheduler.routing.load``) is under its *concurrency limit*, which the
  scheduler computes and publishes in the snapshot (``NodeView.concurrency_limit``) by
  ``scheduler.weights.concurrency_limit``: ``ceil(concurrency_limit_factor x slots)``, at least
  1, with ``slots`` the node's believed decode slots (its capacity, or fewer after queue
  evidence of a silent loss) and the factor a scheduler configuration key (default 1.0: an engine is sent no more
  than it runs at once, so nothing waits inside an engine where a later, more urgent request
  could not overtake it). 0 publishes no limit (flow control then never holds a request).
* **The interactive reserve** (``interactive_reserve``, default 0.1): ``default`` and ``batch``
  requests see each node's limit less ``floor(0.1 x limit)``, or less one slot when ``0.1 x
  limit`` is at least one half (``reserved_limit``: 10 -> 9, 8 -> 7, 5 -> 4, 4 -> 4, 20 -> 18),
  so under overload a slot is usually free when an ``interactive`` request arrives, which then
  waits for no release (SMG's reserved slots). Nodes with a limit under 5 reserve nothing.
* **Bands.** ``interactive`` > ``default`` > ``batch``, strictly: a band is served only when
  every higher band of the pool is empty, except for the **starvation guard**
  (``batch_every``, default 10): while the lowest band waits, at least one dispatch in every
  ``batch_every`` of the pool goes to it.
* **Tenants.** Inside a band, tenants (API key names; requests without a key share ``""``) take
  turns by deficit round robin counted in *work* (``work``: prompt tokens plus ``max_tokens``,
  ``default_max_tokens`` when absent): each turn adds ``quantum`` work units to the tenant's
  deficit, and a tenant sends its head request when its deficit covers that request's work. A
  tenant that empties its queue leaves the round and loses its deficit (DRR's rule: no saving
  up credit while idle). Tenants join at the end of the round in arrival order.
* **Bounds.** Each (pool, band) holds at most ``bound`` requests; the next is refused
  (``QUEUE_FULL``). Each held request has a deadline (its TTL: ``ttl_s``); ``expire(now)``
  removes and returns those past it, oldest deadline first.
* **Across proxies** (``defer_to_peers``): every proxy holds its own queue; the peers' messages
  (``schemas/peers.py``) carry how many requests each holds per band that any node of the pool
  could take (``Held.wide``: a request only some nodes serve is left out, since the pool's free
  slots say nothing of its nodes). A proxy dispatches a request of band ``b`` (directly or from
  its queue) only while the pool's free slots that ``b`` may use (under the reserved limit)
  exceed the requests the fresh peers hold in the bands more urgent than ``b`` (their
  interactive ones counted first into the free slots of the reserve): the slots a release frees
  go to the more urgent band pool-wide, whichever proxy holds it. The starvation guard's turn
  is not deferred.
* **Retry-After** from the pool's recent release rate: the requests ahead of a refused one
  (its band and the higher ones) divided by the releases per second over the last
  ``release_window`` releases, capped at ``retry_after_cap_s``, in whole seconds rounded up and
  never under one: every refusal tells its client when to come back. With no release seen yet
  the estimate is the cap.
* **Rate limits** (``RateLimits``): per key, requests per minute and tokens per minute as
  token buckets refilled continuously (GCRA-like), charged at admission (the work estimate) and
  settled with the real ``usage`` when the request ends (``settle``: the difference is given
  back or charged).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from laswrr.schemas.words import BANDS, Band, RefusalCause

NO_TENANT = ""  # the tenant of every request without an API key

# Peers' conventions, mapped onto the three bands (docs/proxy.md, "Flow control"): an explicit
# name wins; llm-d's InferenceObjective priority is an integer where *higher* is more urgent
# (> 0 interactive, 0 default, < 0 batch); vLLM's and SGLang's request ``priority`` is an integer
# where *lower* is more urgent (the same numbers read the other way), so the header takes names
# only and the mapping is documented for clients to apply, not guessed from a number.
BAND_ALIASES: dict[str, Band] = {
    **{band.value: band for band in Band},
    "critical": Band.INTERACTIVE, "high": Band.INTERACTIVE, "realtime": Band.INTERACTIVE,
    "standard": Band.DEFAULT, "normal": Band.DEFAULT,
    "sheddable": Band.BATCH, "low": Band.BATCH, "background": Band.BATCH,
}


class FlowError(ValueError):
    """A header or keys-file value flow control cannot use; the message says which and why."""


def band_of(header: str | None, key_max: Band = Band.INTERACTIVE) -> Band:
    """The band of a request: its ``x-laswrr-priority`` (``default`` when absent), never more
    urgent than its key's maximum ``key_max``. An unknown name raises ``FlowError``."""
    if header is None or not header.strip():
        band = Band.DEFAULT
    else:
        name = header.strip().lower()
        if name not in BAND_ALIASES:
            raise FlowError(f"x-laswrr-priority must be one of {', '.join(Band)} (got {header[:40]!r})")
        band = BAND_ALIASES[name]
    return band if band.rank >= key_max.rank else key_max


def ttl_s(header: str | None, default_s: float, max_s: float) -> float:
    """The TTL of a held request in seconds: ``x-laswrr-ttl-ms`` (a positive integer) capped at
    ``max_s``, else ``default_s``."""
    if header is None or not header.strip():
        return min(default_s, max_s)
    try:
        ms = int(header.strip())
    except ValueError:
        raise FlowError(f"x-laswrr-ttl-ms must be a positive integer of milliseconds (got {header[:40]!r})") from None
    if ms <= 0:
        raise FlowError(f"x-laswrr-ttl-ms must be a positive integer of milliseconds (got {ms})")
    return min(ms / 1000, max_s)


def work_of(prompt_tokens: int, max_tokens: int | None, default_max_tokens: int) -> int:
    """A request's work for DRR and for tokens per minute: prompt tokens plus the output limit."""
    return max(1, prompt_tokens + (max_tokens if max_tokens is not None else default_max_tokens))


def reserved_limit(limit: int, reserve: float) -> int:
    """The limit a request sees when ``reserve`` (a share) of each node's ``limit`` is kept for
    more urgent ones: ``limit - floor(reserve x limit)``, and one slot kept when ``reserve x
    limit`` is at least one half (8 slots at 0.1 keep one; 4 keep none), at least 1."""
    share = round(reserve * limit, 9)
    return max(1, limit - max(math.floor(share), 1 if share >= 0.5 else 0))


def defer_to_peers(band: Band, peer_held: Mapping[Band, int], free: int | None, reserved_free: int = 0) -> bool:
    """True when a request of ``band`` must leave the pool's ``free`` slots it may use (None:
    unlimited) to the requests the other proxies hold in more urgent bands (``peer_held``: band
    -> count). ``reserved_free``: the free slots of the interactive reserve besides, which only
    interactive requests may use; the peers' interactive requests are counted into them first."""
    if free is None or band is Band.INTERACTIVE or not peer_held:
        return False
    spill = max(0, peer_held.get(Band.INTERACTIVE, 0) - reserved_free)
    ahead = spill + sum(peer_held.get(b, 0) for b in band.at_least_as_urgent()[1:-1])
    return ahead > 0 and free <= ahead


T = TypeVar("T")


@dataclass(slots=True, eq=False)
class Held(Generic[T]):
    """One request waiting in a queue. ``ticket`` is what the caller keeps to wake it."""

    seq: int  # arrival order in this queue, from 1
    pool: str
    band: Band
    tenant: str
    work: int
    arrived: float
    deadline: float
    ticket: T
    queued: bool = True  # False once popped, expired or removed
    wide: bool = True  # any node of the pool may take it (False: only the nodes serving its model id)


@dataclass(slots=True)
class _Band(Generic[T]):
    """One (pool, band): per-tenant FIFOs and the DRR round."""

    tenants: dict[str, deque[Held[T]]] = field(default_factory=dict)
    round: deque[str] = field(default_factory=deque)  # tenants with requests, in turn order
    deficit: dict[str, int] = field(default_factory=dict)
    size: int = 0
    wide: int = 0  # how many of them any node of the pool may take (``Held.wide``)

    def push(self, held: Held[T]) -> None:
        fifo = self.tenants.get(held.tenant)
        if fifo is None:
            fifo = self.tenants[held.tenant] = deque()
            self.round.append(held.tenant)
            self.deficit[held.tenant] = 0
        fifo.append(held)
        self.size += 1
        self.wide += held.wide

    def pop(self, quantum: int) -> Held[T]:
        """DRR: the head of the first tenant in the round whose deficit covers it. The full
        rounds in which no tenant could send are skipped at once (each adds ``quantum`` to every
        deficit), so a pop costs one pass over the round, not one per ``quantum`` of work."""
        skip = min(self._turns(t, quantum) for t in self.round)
        if skip:
            for t in self.round:
                self.deficit[t] += skip * quantum
        while True:
            tenant = self.round[0]
            fifo = self.tenants[tenant]
            head = fifo[0]
            if self.deficit[tenant] >= head.work:
                self.deficit[tenant] -= head.work
                fifo.popleft()
                self.size -= 1
                self.wide -= head.wide
                if not fifo:
                    self._leave(tenant)
                return head
            self.deficit[tenant] += quantum
            self.round.rotate(-1)

    def _turns(self, tenant: str, quantum: int) -> int:
        """Turns ``tenant`` still needs before its head request is covered."""
        short = self.tenants[tenant][0].work - self.deficit[tenant]
        return max(0, -(-short // quantum))

    def remove(self, held: Held[T]) -> None:
        fifo = self.tenants[held.tenant]
        fifo.remove(held)
        self.size -= 1
        self.wide -= held.wide
        if not fifo:
            self._leave(held.tenant)

    def _leave(self, tenant: str) -> None:
        del self.tenants[tenant]
        del self.deficit[tenant]
        self.round.remove(tenant)

    def oldest(self) -> float | None:
        return min((fifo[0].arrived for fifo in self.tenants.values()), default=None)


@dataclass(frozen=True, slots=True)
class FlowConfig:
    bound: int = 1024  # requests held per (pool, band)
    quantum: int = 1024  # work units a tenant's deficit gains per DRR turn
    batch_every: int = 10  # starvation guard: 1 dispatch in this many goes to the waiting lowest band
    default_max_tokens: int = 256  # a request's work when it names no max_tokens
    release_window: int = 64  # releases the Retry-After rate is measured over
    retry_after_cap_s: float = 60.0
    interactive_reserve: float = 0.1  # share of each node's limit only interactive requests may use

    def __post_init__(self) -> None:
        for name in ("bound", "quantum", "batch_every", "release_window"):
            if getattr(self, name) < 1:
                raise FlowError(f"flow control: {name} must be >= 1")
        if not 0 <= self.interactive_reserve < 1:
            raise FlowError("flow control: interactive_reserve must be within 0..1 (1 excluded)")
        if self.default_max_tokens < 0 or not self.retry_after_cap_s >= 1:
            raise FlowError("flow control: default_max_tokens must be >= 0 and retry_after_cap_s >= 1")


@dataclass(slots=True)
class _Pool(Generic[T]):
    bands: list[_Band[T]]
    since_lowest: int = 0  # dispatches since the lowest band last got one while it waited
    releases: deque[float] = field(default_factory=deque)


class FlowQueue(Generic[T]):
    """Every pool's held requests (module docstring); ``T`` is the caller's ticket type."""

    def __init__(self, config: FlowConfig = FlowConfig()) -> None:
        self.config = config
        self.pools: dict[str, _Pool[T]] = {}
        self._deadlines: list[tuple[float, int, Held[T]]] = []  # heap; popped entries skipped lazily
        self._seq = 0
        self.size = 0

    def _pool(self, pool: str) -> _Pool[T]:
        found = self.pools.get(pool)
        if found is None:
            found = self.pools[pool] = _Pool([_Band() for _ in Band])  # by ``Band.rank``
        return found

    def offer(self, pool: str, band: Band, tenant: str, work: int, now: float, ttl: float,
              ticket: T, wide: bool = True) -> Held[T] | RefusalCause:
        """Hold a request; ``RefusalCause.QUEUE_FULL`` when its (pool, band) is at the bound. ``wide``:
        any node of the pool may take it (``wide_depth`` counts those)."""
        bands = self._pool(pool).bands
        if bands[band.rank].size >= self.config.bound:
            return RefusalCause.QUEUE_FULL
        self._seq += 1
        held = Held(self._seq, pool, band, tenant, max(1, work), now, now + ttl, ticket, wide=wide)
        bands[band.rank].push(held)
        heapq.heappush(self._deadlines, (held.deadline, held.seq, held))
        self.size += 1
        return held

    def pop(self, pool: str, upto: Band = Band.BATCH) -> Held[T] | None:
        """The next request to dispatch in ``pool`` (strict bands, the guard, DRR), removed; only
        from the bands up to ``upto`` (``Band.INTERACTIVE``: only a request that may use the reserve)."""
        state = self.pools.get(pool)
        if state is None:
            return None
        bands = state.bands
        lowest = bands[-1]
        choice = self.next_band(pool, upto)
        if choice is None:
            return None
        chosen = bands[choice[0].rank]
        held = chosen.pop(self.config.quantum)
        if chosen is lowest:
            state.since_lowest = 0
        elif lowest.size:
            state.since_lowest += 1
        held.queued = False
        self.size -= 1
        return held

    def next_band(self, pool: str, upto: Band = Band.BATCH) -> tuple[Band, bool] | None:
        """The band ``pop(pool, upto)`` would take a request from, and whether the starvation guard
        chose it (True: the lowest band's guaranteed turn); None when nothing is held there."""
        state = self.pools.get(pool)
        if state is None:
            return None
        bands = state.bands
        if bands[-1].size and state.since_lowest >= self.config.batch_every - 1 and upto is Band.BATCH:
            return BANDS[-1], True
        return next(((b, False) for b in upto.at_least_as_urgent() if bands[b.rank].size), None)

    def remove(self, held: Held[T]) -> bool:
        """Take ``held`` out (its client left, or it is answered otherwise); False if already out."""
        if not held.queued:
            return False
        self.pools[held.pool].bands[held.band.rank].remove(held)
        held.queued = False
        self.size -= 1
        return True

    def expire(self, now: float) -> list[Held[T]]:
        """Remove and return the held requests whose deadline is at or before ``now``."""
        out: list[Held[T]] = []
        heap = self._deadlines
        while heap and (heap[0][0] <= now or not heap[0][2].queued):
            _deadline, _seq, held = heapq.heappop(heap)
            if held.queued:
                self.remove(held)
                out.append(held)
        return out

    def next_deadline(self) -> float | None:
        heap = self._deadlines
        while heap and not heap[0][2].queued:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def held(self, pool: str) -> Iterator[Held[T]]:
        """Every request held in ``pool``, band by band (for a pool whose nodes all left)."""
        state = self.pools.get(pool)
        if state is None:
            return
        for band in state.bands:
            for fifo in list(band.tenants.values()):
                yield from list(fifo)

    def depth(self, pool: str, band: Band | None = None) -> int:
        state = self.pools.get(pool)
        if state is None:
            return 0
        if band is None:
            return sum(b.size for b in state.bands)
        return state.bands[band.rank].size

    def wide_depth(self, pool: str, band: Band) -> int:
        """The requests of ``pool`` and ``band`` held that any node of the pool may take."""
        state = self.pools.get(pool)
        return 0 if state is None else state.bands[band.rank].wide

    def oldest_wait(self, pool: str, band: Band, now: float) -> float:
        state = self.pools.get(pool)
        oldest = state.bands[band.rank].oldest() if state is not None else None
        return 0.0 if oldest is None else max(0.0, now - oldest)

    # -- Retry-After ---------------------------------------------------------------------------

    def released(self, pool: str, now: float) -> None:
        """A request of ``pool`` ended (a slot freed): for the release rate."""
        releases = self._pool(pool).releases
        releases.append(now)
        if len(releases) > self.config.release_window:
            releases.popleft()

    def release_rate(self, pool: str, now: float) -> float | None:
        """Releases per second over the window, counting the time since the last one; None
        before two releases."""
        state = self.pools.get(pool)
        if state is None or len(state.releases) < 2:
            return None
        span = max(now, state.releases[-1]) - state.releases[0]
        return (len(state.releases) - 1) / span if span > 0 else None

    def retry_after(self, pool: str, band: Band, now: float, rate_of: str | None = None) -> int:
        """Whole seconds a refused request of ``band`` should wait (module docstring), at least
        one; ``rate_of``: the key whose releases count, when not ``pool``."""
        ahead = sum(self.depth(pool, b) for b in band.at_least_as_urgent()) + 1
        rate = self.release_rate(pool if rate_of is None else rate_of, now)
        estimate = self.config.retry_after_cap_s if rate is None else min(ahead / rate, self.config.retry_after_cap_s)
        return retry_after_header(estimate)


def retry_after_header(seconds: float) -> int:
    """``Retry-After``'s whole seconds: rounded up, at least 1 (a shorter wait is still one second:
    a 429 or 503 without the header would leave its client to guess)."""
    return max(1, math.ceil(seconds))


# -- per-key rate limits ------------------------------------------------------------------------

@dataclass(slots=True)
class _Bucket:
    level: float  # units left
    at: float  # when ``level`` was measured


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """One API key's flow-control fields from the keys file (``services/proxy/keys.py``)."""

    max_band: Band = Band.INTERACTIVE  # the most urgent band it may use (default: every band)
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens (work) per minute


class RateLimits:
    """Per-key token buckets for requests and tokens per minute (module docstring). A bucket
    holds up to a minute's allowance and refills continuously."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[str, str], _Bucket] = {}

    def _level(self, key: str, kind: str, per_minute: int, now: float) -> _Bucket:
        bucket = self._buckets.get((key, kind))
        if bucket is None:
            bucket = self._buckets[key, kind] = _Bucket(float(per_minute), now)
        elif now > bucket.at:
            bucket.level = min(float(per_minute), bucket.level + (now - bucket.at) * per_minute / 60)
            bucket.at = now
        return bucket

    def charge(self, key: str, limits: KeyLimits, work: int, now: float) -> tuple[RefusalCause, float] | None:
        """Charge one request of ``work`` tokens to ``key``; None when allowed, else the limit
        it hit and the seconds until it would be allowed (nothing charged). A request of more
        work than ``tpm`` costs the whole minute: admitted when the bucket is full, never refused
        for good; ``settle`` then makes the key owe what it used beyond (docs/proxy.md, "Flow control")."""
        checks = []
        if limits.rpm is not None:
            checks.append((RefusalCause.RATE_LIMIT_REQUESTS, "r", limits.rpm, 1.0))
        if limits.tpm is not None:
            checks.append((RefusalCause.RATE_LIMIT_TOKENS, "t", limits.tpm, float(min(work, limits.tpm))))
        buckets = []
        for refused, kind, per_minute, cost in checks:
            bucket = self._level(key, kind, per_minute, now)
            if bucket.level < cost:
                return refused, (cost - bucket.level) * 60 / per_minute
            buckets.append((bucket, cost))
        for bucket, cost in buckets:
            bucket.level -= cost
        return None

    def settle(self, key: str, limits: KeyLimits, charged: int, used: int, now: float) -> None:
        """The request charged ``charged`` tokens used ``used``: give back or take the difference
        (the level may go below 0: the key then waits for it to refill)."""
        if limits.tpm is None or used == charged:
            return
        bucket = self._level(key, "t", limits.tpm, now)
        bucket.level = min(float(limits.tpm), bucket.level + min(charged, limits.tpm) - used)
