"""The channel between proxies, sans IO: it takes the messages received and says what to send.

(docs/proxy.md, "The channel between proxies"; on with ``--peer-interval-ms`` > 0 and a proxy
id.) ``message`` is this proxy's view of a pool for the others: own in-flight and prefill
backlog per node, flow control's held requests per band as ``note_held`` last set them, the
prefix records of the picks since the last message (``tell_prefix``: only the blocks this
proxy's index did not hold on the node yet, and of those only the keys at the grid positions,
``PrefixIndex``, "Sparse records"), at most ``max_keys`` block keys; whole (``PeerState``) at
the heartbeat, at the first message and while flow control holds requests, else the changes
since the last message (``PeerDelta``). What to send, and when, is the shell's question to ask
(``services/proxy/bus.py`` and the virtual bench drain these outboxes):

* ``picks()``: the pools with an admission since the last call, told ``pick_s`` after the first
  of them with the window's others (a burst's picks in one message); while no peer is heard,
  only the first whole view is due (a proxy alone tells nobody).
* ``due(pool, now)``: the interval's message is due: the pool's own counts changed (a first
  byte, a release, held counts) and some peer is heard, or the heartbeat (half ``stale_s``).
  ``next_due(now, interval)``: when to ask again (every interval while a peer is heard, else
  at the next heartbeat: the shell sleeps until then or until a message or a pool arrives).
* ``speak(pool, now, ts_ns, boot_id)``: the next message (counted per pool: a receiver sees a
  gap when one was lost), whole at the heartbeat and when the last whole one is ``full_s``
  old; ``sent`` once it left (one that could not be sent leaves a gap: the peers take no change
  before the next whole view).

``receive`` takes another proxy's: its prefix records go into the pool's index (hints), its
in-flight replaces the snapshot's ``proxy_inflight[peer]`` in ``others`` while its ``ts_ns`` is
after the snapshot's, its backlog joins this proxy's in the work referee, its held counts into
``peer_held``. ``expire(now)`` drops a peer silent for ``stale_s``: its share is then the
snapshot's again, exactly the rule without the channel. ``stagger_s`` is a proxy's wait before a
pick (docs/proxy.md, "Bursts across replicas").
"""

from __future__ import annotations

import math

from laswrr.scheduler.policies.affinity import PrefixIndex, grid_positions
from laswrr.scheduler.routing.route import PeerView, PoolRoute
from laswrr.scheduler.routing.table import RoutingTable
from laswrr.schemas.peers import PeerDelta, PeerMessage, PeerState, PrefixRecord, pack_keys, unpack_keys
from laswrr.schemas.words import Band, Phase

PEER_STALE_S = 2.0  # a peer's message is used this long after it arrived (its heartbeat: every second)
PEER_FULL_S = 5.0  # a busy proxy's messages carry its whole view at least this often (else only changes)
PEER_MAX_KEYS = 256  # prefix block keys per peer message (a whole indexed prompt); beyond, the oldest records go
PEER_GRID = 16  # a peer is told the keys at these grid positions only (PrefixIndex, "Sparse records")
PEER_PICK_S = 0.001  # a pick is told this long after it, with every other pick of the window (pick_s)
PEER_STAGGER_S = 0.010  # a proxy's rank among the replicas it hears times this: its wait before a pick (stagger_s)
PEER_STAGGER_RANKS = 3  # ranks beyond this wait as long as this one: the wait is at most 3 x PEER_STAGGER_S
PEER_STAGGER_SHARE = 0.1  # the whole wait (3 turns) at most this share of the pool's first-byte time (first_byte)
PEER_STAGGER_MIN_S = 0.0005  # a turn shorter than this is no wait at all
FIRST_BYTE_WEIGHT = 0.05  # the weight of each request's first-byte time in the moving average


class PeerChannel:
    def __init__(self, table: RoutingTable, stale_s: float = PEER_STALE_S, max_keys: int = PEER_MAX_KEYS,
                 full_s: float = PEER_FULL_S, grid: int = PEER_GRID, stagger_s: float = PEER_STAGGER_S,
                 pick_s: float = PEER_PICK_S) -> None:
        if table.proxy_id is None:
            raise ValueError("the channel between proxies needs a proxy id")
        self.table = table
        self.proxy_id: str = table.proxy_id
        self.stale_s, self.full_s, self.max_keys = stale_s, full_s, max_keys
        self.grid = grid  # 0: every key of a record is sent (no sparse records)
        self.stagger_s_max = stagger_s  # 0: no proxy waits before its picks
        self.pick_s = pick_s  # 0: each event-loop turn's picks at once
        self.first_byte_s: float | None = None  # moving average of the requests' first-byte times
        self.changed: set[str] = set()  # pools whose own counts or records changed since their last message
        self.picked: set[str] = set()  # the pick outbox: pools with an admission not told yet (``picks``)
        # pool -> (band -> requests flow control holds that any node may take, band -> oldest age ms)
        self.held: dict[str, tuple[dict[Band, int], dict[Band, int]]] = {}
        self._seq: dict[str, int] = {}  # pool -> its messages' counter
        self._sent_at: dict[str, float] = {}  # pool -> when its last message went
        self._full_at: dict[str, float] = {}  # pool -> when its last whole view went

    def tell_prefix(self, route: PoolRoute, index: PrefixIndex, node: str, keys: list[int]) -> None:
        """A pick of ``node`` for a prompt of ``keys`` (before the index records it): the blocks
        the index did not hold on the node yet go to the pool's next message."""
        held = index.depths(keys, (node,))[node] if keys else 0
        if len(keys) <= held:
            return
        told = [keys[p] for p in grid_positions(len(keys), self.grid) if p >= held] if self.grid else keys[held:]
        if told:
            route.outbox.append(PrefixRecord(node, pack_keys(told)))
        if len(route.outbox) > self.max_keys:  # never sent (NATS away): bounded all the same
            del route.outbox[0]

    def touch(self, pool: str, pick: bool = False) -> None:
        """The pool's own counts changed; ``pick``: by an admission, told within ``pick_s``
        (``picks``) while some peer is heard or before the first whole view."""
        self.changed.add(pool)
        route = self.table.route(pool)
        if pick and route is not None and (route.peers or route.told is None):
            self.picked.add(pool)

    def picks(self) -> list[str]:
        """Drain the pick outbox: the pools picked since the last call whose message is still to
        tell them (an interval's message may have told the window's picks already)."""
        pools, self.picked = self.picked, set()
        return [pool for pool in pools if pool in self.changed]

    def due(self, pool: str, now: float) -> bool:
        """The pool's interval message is due (module docstring)."""
        if now - self._sent_at.get(pool, -math.inf) >= self.stale_s / 2:
            return True
        route = self.table.route(pool)
        return pool in self.changed and route is not None and bool(route.peers)

    def next_due(self, now: float, interval: float) -> float:
        """When the shell's interval loop must look again (``due``, ``expire``) if no message is
        received and no pool appears: ``now + interval`` while some pool hears a peer (its changes
        go within an interval, a silent peer is dropped within one); else the next heartbeat (a
        proxy alone tells nobody of its changes), at least one interval and at most one
        heartbeat period away."""
        heartbeat = self.stale_s / 2
        soonest = now + heartbeat
        for pool, route in self.table.routes():
            if route.peers:
                return now + interval
            soonest = min(soonest, self._sent_at.get(pool, -math.inf) + heartbeat)
        return max(now + interval, soonest)

    def speak(self, pool: str, now: float, ts_ns: int, boot_id: str) -> PeerMessage | None:
        """The pool's next message, whole at the heartbeat or when the last whole one is
        ``full_s`` old (None: no such pool)."""
        seq = self._seq[pool] = self._seq.get(pool, 0) + 1
        since_s = now - self._sent_at.get(pool, -math.inf)
        full = since_s >= self.stale_s / 2 or now - self._full_at.get(pool, -math.inf) >= self.full_s
        return self.message(pool, boot_id, seq, ts_ns, full)

    def sent(self, pool: str, message: PeerMessage, now: float) -> None:
        """``message`` of ``pool`` left at ``now``."""
        self._sent_at[pool] = now
        if isinstance(message, PeerState):
            self._full_at[pool] = now

    def message(self, pool: str, boot_id: str, seq: int, ts_ns: int, full: bool = False) -> PeerMessage | None:
        """This proxy's view of ``pool`` for the others (None: no such pool), with the prefix
        records added since the last call, newest kept within ``max_keys`` block keys: the changes
        since its last message, or the whole view when ``full``, for its first message, and while
        flow control holds requests (their ages move without a change). A heartbeat while no peer
        is heard carries no records (they are dropped: nobody listens)."""
        route = self.table.route(pool)
        self.changed.discard(pool)
        if route is None:
            return None
        nodes = {view.node for view in route.snapshot.nodes}
        records: list[PrefixRecord] = []
        room = 0 if full and not route.peers else self.max_keys  # a heartbeat to nobody: no records
        for record in reversed(route.outbox):
            if room <= 0:
                break
            count = min(record.count, room)  # the leading blocks matter most
            records.append(record if count == record.count else PrefixRecord(record.node, record.keys[:4 * count]))
            room -= count
        route.outbox.clear()
        records.reverse()
        held, oldest = self.held.get(pool, ({}, {}))
        load = self.table.load
        inflight = {n: c for n, c in load.own.items() if n in nodes}
        backlog = {n: t for n, t in load.backlog.items() if n in nodes}
        told, route.told = route.told, (inflight, backlog, bool(held))
        if full or told is None or held or told[2]:
            return PeerState(boot_id=boot_id, seq=seq, ts_ns=ts_ns, inflight=inflight, backlog=backlog,
                             held=dict(held), held_oldest_ms=dict(oldest), prefixes=records)
        return PeerDelta(seq=seq, ts_ns=ts_ns, inflight=_changes(told[0], inflight), backlog=_changes(told[1], backlog),
                         prefixes=records)

    def note_held(self, pool: str, held: dict[Band, int], oldest_ms: dict[Band, int]) -> None:
        """Flow control's held requests of ``pool`` per band (> 0 only) and the oldest one's age,
        for the next message; a changed count makes the pool ``changed`` (sent within one interval)."""
        before = self.held.get(pool)
        if held:
            self.held[pool] = (held, oldest_ms)
        else:
            self.held.pop(pool, None)
        if (before[0] if before is not None else {}) != held:
            self.changed.add(pool)

    def receive(self, proxy: str, pool: str, message: PeerMessage, now: float) -> bool:
        """Take another proxy's message about ``pool`` (``now``: monotonic seconds); False when
        ignored (this proxy's own, an unknown pool, a state not newer than the one held from the
        same boot, a delta that does not follow the message held)."""
        route = self.table.route(pool)
        if route is None or proxy == self.proxy_id or not proxy:
            return False
        held = route.peers.get(proxy)
        if isinstance(message, PeerDelta):
            if held is None or message.seq != held.seq + 1:
                return False  # a message was missed: wait for the next whole view
            held.seq, held.ts_ns, held.received_at = message.seq, message.ts_ns, now
            _apply(held.inflight, message.inflight)
            _apply(held.backlog, message.backlog)
        else:
            if held is not None and held.boot_id == message.boot_id and message.seq <= held.seq:
                return False
            if held is None or held.boot_id != message.boot_id:
                # a peer new to this proxy (started, restarted, or back after a silence) has not
                # heard its whole view: the next message, within one interval, carries it
                route.told = None
                self.changed.add(pool)
            route.peers[proxy] = PeerView(message.boot_id, message.seq, message.ts_ns, now, dict(message.inflight),
                                          dict(message.backlog), dict(message.held), dict(message.held_oldest_ms))
        index = route.index
        if index is not None and message.prefixes:
            kept = {view.node for view in route.snapshot.nodes if view.phase != Phase.EJECTED}
            if self.grid:
                index.grid = self.grid  # sparse records from now on: match looks at the grid too
            for record in message.prefixes:
                if record.node in kept and record.keys and len(record.keys) % 4 == 0:  # else a hint lost
                    index.record(record.node, unpack_keys(record.keys)[:index.max_prompt_blocks])
        self.table.repeer(route)
        return True

    def expire(self, now: float) -> int:
        """Drop every peer whose last message is older than ``stale_s``; how many went. Without a
        peer the pool routes on the snapshot's counts: exactly the rule without the channel."""
        gone = 0
        for _, route in self.table.routes():
            stale = [p for p, view in route.peers.items() if now - view.received_at > self.stale_s]
            for proxy in stale:
                del route.peers[proxy]
            if stale:
                gone += len(stale)
                self.table.repeer(route)
        return gone

    def peer_held(self, pool: str) -> dict[Band, int]:
        """Per band, the requests the fresh peers' flow control holds for ``pool`` (summed): the
        ones any node of the pool may take (``scheduler.routing.flow.defer_to_peers``)."""
        held: dict[Band, int] = {}
        route = self.table.route(pool)
        for view in route.peers.values() if route is not None else ():
            for band, count in view.held.items():
                held[band] = held.get(band, 0) + count
        return held

    def stagger_s(self, pool: str) -> float:
        """How long this proxy waits before a request's pick in ``pool``: its rank among itself and
        the peers it hears there (by proxy id), times ``stagger_s_max``'s turn. The replicas that
        take one burst between them then pick in turn, each after the picks of those ranked before
        it have reached it, as one proxy picks a burst one request after the other. Ranks past
        ``PEER_STAGGER_RANKS`` wait as long as that one, and a turn is shortened so that the
        longest wait is at most ``PEER_STAGGER_SHARE`` of the requests' first-byte time
        (``first_byte``). 0 for the first in rank, alone, or when a turn would be under
        ``PEER_STAGGER_MIN_S``."""
        route = self.table.route(pool)
        if not self.stagger_s_max or route is None or not route.peers:
            return 0.0
        turn = self.stagger_s_max
        if self.first_byte_s is not None:
            turn = min(turn, PEER_STAGGER_SHARE * self.first_byte_s / PEER_STAGGER_RANKS)
        if turn < PEER_STAGGER_MIN_S:
            return 0.0
        return min(PEER_STAGGER_RANKS, sum(proxy < self.proxy_id for proxy in route.peers)) * turn

    def first_byte(self, seconds: float) -> None:
        """A request's first byte came ``seconds`` after it arrived: the moving average that
        bounds ``stagger_s``."""
        if seconds < 0:
            return
        mean = self.first_byte_s
        self.first_byte_s = seconds if mean is None else mean + FIRST_BYTE_WEIGHT * (seconds - mean)


def _changes(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Per key, ``after`` less ``before`` (!= 0 only; a missing key counts 0)."""
    changes = {key: value - before.get(key, 0) for key, value in after.items() if value != before.get(key, 0)}
    for key, value in before.items():
        if key not in after:
            changes[key] = -value
    return changes


def _apply(counts: dict[str, int], changes: dict[str, int]) -> None:
    """``counts`` plus ``changes``, keeping positive counts only."""
    for key, change in changes.items():
        value = counts.get(key, 0) + change
        if value > 0:
            counts[key] = value
        else:
            counts.pop(key, None)
