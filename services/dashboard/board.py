"""The dashboard's fold: log messages in, the page's JSON out (pure: no IO, no clock).

Theory of operation. ``Board.apply(subject, ts_ns, data)`` folds one message of the log, live
(services/dashboard/app.py subscribes) or recorded (the DuckDB ``events`` table, in time
order), and returns what a live page must be told (``Push``: a snapshot, a mark). What it keeps,
per pool, in time order:

* every weight snapshot (``lb.out.snapshot.<pool>``, at its own ``ts_ns``), as table rows;
* marks on the time axis: capacity changes and other admin actions (``lb.admin.*``), phase
  changes (``lb.out.phase.*``: drains, ejections, slow start, ...) and rejections
  (``lb.out.rejected``, in the pool of the node its subject names, else every pool);
* request outcomes (``lb.req.finished.<node>``: outcome, TTFT of a streamed answer, duration, the engine's status
  class, alone or inside a proxy's ``lb.req.batch.<proxy>``, at the batch's time; an event of
  a batch that does not decode is counted as undecodable, its neighbours still count), and the
  proxies' own refusals (``lb.req.refused.<proxy>``: outcome ``refused``, "router 4xx"/"5xx");
* per node, npu-smi health (the worst chip of ``lb.metrics.npu.<node>``) whenever it changes;
* flow control's queue depth per band (``queued``): a request held (``lb.req.queued.<proxy>``)
  counts in its pool and band from then until the event that ends it, ``lb.req.started`` (it was
  dispatched) or ``lb.req.refused`` (expired, no node, client gone) with the same request id,
  whichever proxy held it: the depth is the whole pool's, every proxy's queue summed.

Queries take the moment ``at_ns`` (now, or the scrubber's position over a recorded log):
``state(at)`` is the node table of every pool as of then, its queue depth per band (``queue``),
with the request statistics of the sliding window before it (rate, outcomes, answers by who gave them and status class, TTFT and
E2E P50/P99 over completed requests);
``history(at, window_s)`` the curves of the window before it (effective and target weight,
in-flight and phase per node, request counts per second, queue depth per band) and the marks. ``trim(before)`` drops
what a live board no longer shows. A message that does not decode is counted
(``undecodable``) and skipped: the dashboard shows the log, it never judges it.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec

from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import SchemaError, decode_batch, decode_event
from laswrr.schemas.events import (
    CapacitySet, NodeRegistered, NpuSampled, RequestFinished, RequestQueued, RequestRefused, RequestStarted,
)
from laswrr.schemas.outputs import PhaseChanged, Rejected, WeightSnapshot
from laswrr.schemas.words import NPU_SEVERITY, Band, NpuHealth, Phase, RequestOutcome

MS = 1_000_000
S = 1_000_000_000
ALL_POOLS = "*"
REQUEST_WINDOW_S = 60.0  # the sliding window of the request statistics
MAX_POINTS = 1500  # per node and query: denser curves are thinned (marks never are)

_SNAPSHOT = msgspec.json.Decoder(WeightSnapshot)
_PHASE = msgspec.json.Decoder(PhaseChanged)
_REJECTED = msgspec.json.Decoder(Rejected)

# A phase change's mark kind, by the phase entered.
PHASE_MARKS = {Phase.DRAINING: "drain", Phase.DRAINED: "drain", Phase.EJECTED: "ejected", Phase.RECOVERING: "slow start",
               Phase.ACTIVE: "active", Phase.REMOVED: "removed"}


@dataclass(frozen=True, slots=True)
class Push:
    """What a live page is sent: ``kind`` "snapshot" (``data``: one pool's rows) or "mark"."""

    kind: str
    pool: str
    data: dict[str, Any]


@dataclass(slots=True)
class _Snapshot:
    ts_ns: int
    as_of_seq: int
    panic: bool
    rows: list[dict[str, Any]]


@dataclass(slots=True)
class _Pool:
    snapshots: list[_Snapshot] = field(default_factory=list)
    snapshot_ts: list[int] = field(default_factory=list)
    marks: list[tuple[int, str, str, str]] = field(default_factory=list)  # ts_ns, node, kind, text
    # (ts_ns, outcome, ttft_ms (None for an answer not streamed: RequestFinished.first_token_ms), duration_ms,
    # who answered and the status class: "engine 2xx", "router 4xx", ...)
    requests: list[tuple[int, str, float | None, float | None, str]] = field(default_factory=list)
    # flow control's held requests: per band, (ts_ns, depth) at each change, in time order
    queued: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: {band.value: [] for band in Band})


def _ts(entry: tuple[Any, ...]) -> int:
    return int(entry[0])


def row_of(view: Any) -> dict[str, Any]:
    """One node's table row from a snapshot's ``NodeView``."""
    load = view.load
    return {"node": view.node, "phase": view.phase, "routable": view.routable, "capacity": view.capacity,
            "slots": view.capacity if load.slots is None else load.slots, "chip": view.chip,
            "target_weight": view.target_weight, "effective_weight": view.effective_weight,
            "inflight": view.inflight, "health": view.health, "load": load.load,
            "sample_age_ms": load.sample_age_ms, "stale": load.stale, "phase_reason": view.phase_reason,
            "free_slots": load.free_slots, "free_blocks": load.free_blocks}


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of an ascending list; None when empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


class Board:
    def __init__(self) -> None:
        self.pools: dict[str, _Pool] = {}
        self.node_pool: dict[str, str] = {}
        self.waiting: dict[str, list[tuple[int, str, str]]] = {}  # node -> marks until its pool is known
        self.npu: dict[str, list[tuple[int, str]]] = {}  # node -> (ts_ns, worst health) at each change
        self.undecodable = 0
        self.held: dict[str, tuple[str, str, int]] = {}  # request id -> (pool, band, queued at) while held
        self.first_ns: int | None = None
        self.last_ns: int | None = None

    # -- folding --------------------------------------------------------------------------------

    def apply(self, subject: str, ts_ns: int, data: bytes) -> list[Push]:
        self.first_ns = ts_ns if self.first_ns is None else min(self.first_ns, ts_ns)
        self.last_ns = ts_ns if self.last_ns is None else max(self.last_ns, ts_ns)
        try:
            if subject.startswith(sj.OUT_SNAPSHOT + "."):
                return self._snapshot(_SNAPSHOT.decode(data))
            if subject.startswith(sj.OUT_PHASE + "."):
                return self._phase(ts_ns, _PHASE.decode(data))
            if subject == sj.OUT_REJECTED:
                return self._rejected(ts_ns, _REJECTED.decode(data))
            if subject.startswith((sj.ADMIN + ".", sj.REQ_FINISHED + ".", sj.REQ_REFUSED + ".", sj.METRICS_NPU + ".",
                                   sj.REQ_QUEUED + ".", sj.REQ_STARTED + ".")):
                return self._input(subject, ts_ns, data)
            if subject.startswith(sj.REQ_BATCH + "."):
                return self._batch(subject, ts_ns, data)
        except (msgspec.DecodeError, msgspec.ValidationError, SchemaError):
            self.undecodable += 1
        return []

    def _pool(self, pool: str) -> _Pool:
        found = self.pools.get(pool)
        if found is None:
            found = self.pools[pool] = _Pool()
        return found

    def _snapshot(self, snapshot: WeightSnapshot) -> list[Push]:
        pool = self._pool(snapshot.pool)
        rows = [row_of(view) for view in snapshot.nodes]
        pushes: list[Push] = []
        for row in rows:
            pushes += self._pool_of(row["node"], snapshot.pool)
        entry = _Snapshot(snapshot.ts_ns, snapshot.as_of_seq, snapshot.panic, rows)
        at = bisect_right(pool.snapshot_ts, snapshot.ts_ns)
        pool.snapshot_ts.insert(at, snapshot.ts_ns)
        pool.snapshots.insert(at, entry)
        return [Push("snapshot", snapshot.pool, self._snapshot_json(entry)), *pushes]

    def _pool_of(self, node: str, pool: str, first: bool = False) -> list[Push]:
        """``node`` is in ``pool`` (``first``: unless known already); the marks that waited for it go there."""
        if first and node in self.node_pool:
            return []
        self.node_pool[node] = pool
        pushes = []
        for ts_ns, kind, text in self.waiting.pop(node, []):
            pushes += self._mark(ts_ns, node, kind, text)
        return pushes

    def _mark(self, ts_ns: int, node: str | None, kind: str, text: str, of_node: bool = True) -> list[Push]:
        """A mark on the chart of ``node``'s pool; a node whose pool is not known yet (its admin
        events folded before its first snapshot: the two streams are read apart) waits for it,
        rather than landing on every pool's chart. Marks of no node (``of_node`` False: the
        scheduler's configuration) and rejections naming an unknown key (a proxy's batch, a typo'd
        node id) go to every pool."""
        if node and of_node and node not in self.node_pool:
            self.waiting.setdefault(node, []).append((ts_ns, kind, text))
            return []
        pool = self.node_pool.get(node or "", ALL_POOLS)
        targets = list(self.pools) if pool == ALL_POOLS else [pool]
        pushes = []
        for name in targets:
            insort(self._pool(name).marks, (ts_ns, node or "", kind, text))
            pushes.append(Push("mark", name, {"ts_ms": ts_ns // MS, "node": node or "", "kind": kind, "text": text}))
        return pushes

    def _phase(self, ts_ns: int, change: PhaseChanged) -> list[Push]:
        pushes = self._pool_of(change.node, change.pool, first=True)
        text = f"{change.node}: {change.from_} -> {change.to} ({change.reason})"
        return pushes + self._mark(ts_ns, change.node, PHASE_MARKS.get(change.to, change.to), text)

    def _rejected(self, ts_ns: int, rejected: Rejected) -> list[Push]:
        _, node = sj.split(rejected.subject)  # a rejection may name a node that never was (a typo): not held
        return self._mark(ts_ns, node, "rejected", f"{rejected.subject} rejected: {rejected.reason}", of_node=False)

    def _finished(self, ts_ns: int, event: RequestFinished | RequestRefused) -> None:
        if isinstance(event, RequestRefused):  # the proxy's own answer: no node, no attempt
            pool = self._pool(event.pool or "default")
            entry = (ts_ns, "refused", None, None, f"router {event.status // 100}xx")
        else:
            pool = self._pool(event.pool)
            answer = "engine none" if event.status is None else f"engine {event.status // 100}xx"
            entry = (ts_ns, event.outcome, event.first_token_ms, event.duration_ms, answer)
        if pool.requests and pool.requests[-1][0] > ts_ns:
            insort(pool.requests, entry, key=_ts)
        else:
            pool.requests.append(entry)

    def _queue(self, ts_ns: int, event: RequestQueued | RequestStarted | RequestRefused) -> None:
        """A request held, or the end of one held (dispatched or answered): the pool's depth."""
        if isinstance(event, RequestQueued):
            if event.request_id in self.held:
                return
            self.held[event.request_id] = (event.pool, event.band, ts_ns)
            pool, band, step = event.pool, event.band, 1
        else:
            found = self.held.pop(event.request_id, None)
            if found is None:
                return
            pool, band, step = found[0], found[1], -1
        self._step(pool, band, ts_ns, step)

    def _step(self, pool: str, band: str, ts_ns: int, step: int) -> None:
        changes = self._pool(pool).queued[band]
        at = bisect_right(changes, (ts_ns, math.inf)) if changes and changes[-1][0] > ts_ns else len(changes)
        before = changes[at - 1][1] if at else 0
        changes.insert(at, (ts_ns, max(0, before + step)))
        for i in range(at + 1, len(changes)):  # an event folded out of time order: the later depths move too
            changes[i] = (changes[i][0], max(0, changes[i][1] + step))

    def _request(self, ts_ns: int, event: Any) -> None:
        if isinstance(event, (RequestQueued, RequestStarted)):
            self._queue(ts_ns, event)
            return
        if isinstance(event, RequestRefused):
            self._queue(ts_ns, event)
        self._finished(ts_ns, event)

    def _batch(self, subject: str, ts_ns: int, data: bytes) -> list[Push]:
        for item in decode_batch(subject, data)[1]:
            if item.error is not None:
                self.undecodable += 1
            elif isinstance(item.event, (RequestFinished, RequestRefused, RequestQueued, RequestStarted)):
                self._request(ts_ns, item.event)
        return []

    def _input(self, subject: str, ts_ns: int, data: bytes) -> list[Push]:
        node, event = decode_event(subject, data)
        if isinstance(event, (RequestFinished, RequestRefused, RequestQueued, RequestStarted)):
            self._request(ts_ns, event)
            return []
        if isinstance(event, NpuSampled):
            worst = max((NpuHealth.of(c.health) for c in event.chips), key=NPU_SEVERITY.__getitem__,
                        default=NpuHealth.UNKNOWN)
            changes = self.npu.setdefault(node or "", [])
            if not changes or changes[-1][1] != worst:
                changes.append((ts_ns, worst))
            return []
        verb = sj.split(subject)[0].rsplit(".", 1)[-1]
        if isinstance(event, NodeRegistered) and node is not None:
            pushes = self._pool_of(node, event.pool, first=True)
            return pushes + self._mark(ts_ns, node, "admin", f"{node}: registered (capacity {event.capacity})")
        if isinstance(event, CapacitySet):
            return self._mark(ts_ns, node, "capacity", f"{node}: capacity set to {event.capacity}")
        return self._mark(ts_ns, node, "admin", f"{node or 'scheduler'}: {verb}")

    # -- queries --------------------------------------------------------------------------------

    def npu_health(self, node: str, at_ns: int) -> str | None:
        changes = self.npu.get(node, [])
        i = bisect_right(changes, (at_ns, "\uffff"))
        return changes[i - 1][1] if i else None

    def _snapshot_json(self, snap: _Snapshot) -> dict[str, Any]:
        rows = [{**row, "npu_health": self.npu_health(row["node"], snap.ts_ns)} for row in snap.rows]
        return {"ts_ms": snap.ts_ns // MS, "as_of_seq": snap.as_of_seq, "panic": snap.panic, "nodes": rows}

    def request_stats(self, pool: str, at_ns: int, window_s: float = REQUEST_WINDOW_S) -> dict[str, Any]:
        requests = self.pools[pool].requests if pool in self.pools else []
        window = requests[bisect_left(requests, at_ns - int(window_s * S), key=_ts):
                          bisect_right(requests, at_ns, key=_ts)]
        outcomes = Counter(entry[1] for entry in window)
        answers = Counter(entry[4] for entry in window)
        ttft = sorted(t for _, o, t, _, _ in window if o == RequestOutcome.COMPLETED and t is not None)
        e2e = sorted(d for _, o, _, d, _ in window if o == RequestOutcome.COMPLETED and d is not None)
        return {"window_s": window_s, "count": len(window), "rate_per_s": round(len(window) / window_s, 3),
                "outcomes": dict(sorted(outcomes.items())), "answers": dict(sorted(answers.items())),
                "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
                "e2e_ms": {"p50": percentile(e2e, 50), "p99": percentile(e2e, 99)}}

    def queue_depth(self, pool: str, at_ns: int) -> dict[str, int]:
        """Flow control's held requests of ``pool`` per band as of ``at_ns`` (every proxy's)."""
        found = self.pools.get(pool)
        depth = {}
        for band in Band:
            changes = found.queued[band] if found is not None else []
            i = bisect_right(changes, (at_ns, math.inf))
            depth[band.value] = changes[i - 1][1] if i else 0
        return depth

    def state(self, at_ns: int) -> dict[str, Any]:
        """The node table of every pool as of ``at_ns``, its queue depth per band and its request statistics."""
        pools = {}
        for name, pool in sorted(self.pools.items()):
            i = bisect_right(pool.snapshot_ts, at_ns)
            snap = self._snapshot_json(pool.snapshots[i - 1]) if i else {"ts_ms": None, "nodes": []}
            pools[name] = {**snap, "queue": self.queue_depth(name, at_ns), "requests": self.request_stats(name, at_ns)}
        return {"at_ms": at_ns // MS, "pools": pools}

    def queue_series(self, pool: str, start_ns: int, end_ns: int) -> dict[str, list[list[int]]]:
        """Per band, ``[ts_ms, depth]`` at each change in the range, from the depth at its start
        (a point at ``start``), thinned to ``MAX_POINTS`` (each kept point is a real change)."""
        found = self.pools.get(pool)
        series: dict[str, list[list[int]]] = {}
        for band in Band:
            changes = found.queued[band] if found is not None else []
            lo, hi = bisect_right(changes, (start_ns, math.inf)), bisect_right(changes, (end_ns, math.inf))
            points = [[start_ns // MS, changes[lo - 1][1] if lo else 0]]
            window = changes[lo:hi]
            step = max(1, math.ceil(len(window) / MAX_POINTS))
            points += [[ts // MS, depth] for ts, depth in window[::step]]
            if window and (len(window) - 1) % step:
                points.append([window[-1][0] // MS, window[-1][1]])
            series[band.value] = points
        return series

    def history(self, at_ns: int, window_s: float) -> dict[str, Any]:
        """Curves and marks of the ``window_s`` before ``at_ns``, per pool."""
        start = at_ns - int(window_s * S)
        pools = {}
        for name, pool in sorted(self.pools.items()):
            lo, hi = bisect_left(pool.snapshot_ts, start), bisect_right(pool.snapshot_ts, at_ns)
            chosen = pool.snapshots[lo:hi]
            step = max(1, math.ceil(len(chosen) / MAX_POINTS))
            if step > 1:
                chosen = chosen[::step] + ([chosen[-1]] if (len(chosen) - 1) % step else [])
            series: dict[str, list[list[Any]]] = {}
            for snap in chosen:
                for row in snap.rows:
                    series.setdefault(row["node"], []).append(
                        [snap.ts_ns // MS, row["effective_weight"], row["target_weight"], row["inflight"], row["phase"]])
            marks = [[ts // MS, node, kind, text] for ts, node, kind, text in
                     pool.marks[bisect_left(pool.marks, (start,)):bisect_right(pool.marks, (at_ns, "\uffff"))]]
            pools[name] = {"series": series, "marks": marks, "rate": self.rate_bins(name, start, at_ns),
                           "queue": self.queue_series(name, start, at_ns)}
        return {"at_ms": at_ns // MS, "window_s": window_s, "pools": pools}

    def rate_bins(self, pool: str, start_ns: int, end_ns: int, bin_s: int = 1) -> list[list[int]]:
        """``[second_ms, completed, not completed]`` per ``bin_s`` of finished requests in the range."""
        requests = self.pools[pool].requests if pool in self.pools else []
        width = bin_s * S
        bins: dict[int, list[int]] = {}
        for ts, outcome, _, _, _ in requests[bisect_left(requests, start_ns, key=_ts):
                                          bisect_right(requests, end_ns, key=_ts)]:
            counts = bins.setdefault(ts // width, [0, 0])
            counts[0 if outcome == RequestOutcome.COMPLETED else 1] += 1
        return [[key * width // MS, ok, bad] for key, (ok, bad) in sorted(bins.items())]

    def trim(self, before_ns: int) -> None:
        """Forget what is older than ``before_ns`` (a live board keeps a bounded past), keeping
        each pool's newest snapshot before it so the table still has a row."""
        for pool in self.pools.values():
            cut = max(0, bisect_left(pool.snapshot_ts, before_ns) - 1)
            del pool.snapshots[:cut], pool.snapshot_ts[:cut]
            del pool.marks[:bisect_left(pool.marks, (before_ns,))]
            del pool.requests[:bisect_left(pool.requests, before_ns, key=_ts)]
            for changes in pool.queued.values():
                del changes[:max(0, bisect_left(changes, (before_ns,)) - 1)]  # the depth at the cut stays
        for changes in self.npu.values():
            del changes[:max(0, bisect_left(changes, (before_ns,)) - 1)]
        # a request held since before the kept past whose end never came (its proxy died): forgotten
        for request_id in [r for r, (_, _, at) in self.held.items() if at < before_ns]:
            pool_name, band, _ = self.held.pop(request_id)
            self._step(pool_name, band, before_ns, -1)
