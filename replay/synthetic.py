"""Crafted logs for tests and benchmarks, recorded exactly as the running stack records them.

``LogBuilder`` plays the stream and the scheduler service: each ``add`` assigns the next
LB_EVENTS sequence number and an event time, applies the input to the real core through the
service's fold (``scheduler.fold.Fold``), and appends the core's outputs to LB_OUT the way the
service publishes them (the fold drops a repeated ``Nats-Msg-Id`` = ``Output.msg_id`` as
JetStream's de-duplication drops it).
``write_db`` stores both streams in a DuckDB file through ``replay.store`` (the recorder's own
insert path). ``workload`` builds a realistic mixed log: node registrations, 100 ms ticks, engine
samples, request start/finish pairs, a capacity drop and a drain.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from laswrr.replay import store
from laswrr.replay.portable import input_line
from laswrr.scheduler.config import SchedulerConfig
from laswrr.scheduler.fold import Fold
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope
from laswrr.schemas.words import RequestOutcome
from laswrr.schemas.codec import decode_snapshot

MS = 1_000_000
T0_NS = 1_700_000_000_000_000_000


class LogBuilder:
    def __init__(self, config: SchedulerConfig | None = None, start_ns: int = T0_NS) -> None:
        self.fold = Fold(config=config, dedupe=True)
        self.scheduler = self.fold.scheduler
        self.inputs = store.Columns(sj.EVENTS_STREAM)
        self.outputs = store.Columns(sj.OUT_STREAM)
        self.now_ns = start_ns
        self.tick_no = 0

    @property
    def seq(self) -> int:
        return len(self.inputs)

    def add(self, subject: str, payload: Any = None, after_ms: float = 1.0) -> int:
        """Append one input (dict -> JSON, str/bytes -> raw text) ``after_ms`` after the last."""
        self.now_ns += int(after_ms * MS)
        if isinstance(payload, bytes):
            raw = payload
        elif isinstance(payload, str):
            raw = payload.encode()
        else:
            raw = msgspec.json.encode({} if payload is None else payload)
        seq = len(self.inputs) + 1
        self.inputs.append(seq, self.now_ns, subject, raw)
        for output in self.fold.apply(Envelope(seq, self.now_ns, subject, raw)):
            self.outputs.append(len(self.outputs) + 1, self.now_ns + 200_000, output.subject, output.data)
        return seq

    # -- shorthands ------------------------------------------------------------------------

    def node(self, node: str, capacity: int, pool: str = "default", chip: str = "910B") -> int:
        return self.add(sj.admin_node(node), {"url": f"http://{node}:8000", "capacity": capacity,
                                              "pool": pool, "chip": chip})

    def tick(self, after_ms: float = 100.0) -> int:
        self.tick_no += 1
        return self.add(sj.CLOCK_TICK, {"tick": self.tick_no}, after_ms)

    def started(self, node: str, request_id: str, proxy: str = "p1", pool: str = "default",
                snapshot_seq: int | None = None, after_ms: float = 1.0) -> int:
        payload: dict[str, Any] = {"request_id": request_id, "proxy": proxy, "pool": pool}
        if snapshot_seq is not None:
            payload["snapshot_seq"] = snapshot_seq
        return self.add(sj.req_started(node), payload, after_ms)

    def finished(self, node: str, request_id: str, outcome: str = RequestOutcome.COMPLETED, proxy: str = "p1",
                 ttft_ms: float | None = 50.0, duration_ms: float = 800.0, after_ms: float = 1.0,
                 **fields: object) -> int:
        """``fields``: more ``lb.req.finished`` keys (completion_tokens, error, next_attempt, ...)."""
        return self.add(sj.req_finished(node), {"request_id": request_id, "proxy": proxy, "outcome": outcome,
                                                "ttft_ms": ttft_ms, "duration_ms": duration_ms, **fields}, after_ms)

    def last_snapshot_seq(self, pool: str = "default") -> int:
        """The as_of_seq of the latest snapshot of ``pool`` (what a proxy routes on)."""
        prefix = sj.out_snapshot(pool)
        for index in range(len(self.outputs) - 1, -1, -1):
            if self.outputs.subject[index] == prefix:
                return decode_snapshot(self.outputs.data[index]).as_of_seq
        return 0

    # -- output -----------------------------------------------------------------------------

    def write_db(self, path: str | os.PathLike[str]) -> None:
        con = store.open_writer(path)
        try:
            store.insert_rows(con, [self.inputs, self.outputs])
        finally:
            con.close()

    def jsonl(self) -> bytes:
        """The inputs in the portable form (``laswrr replay --events``)."""
        inputs = self.inputs
        return b"".join(input_line(inputs.seq[i], inputs.ts_ns[i], inputs.subject[i], inputs.payload(i))
                        for i in range(len(inputs)))


def workload(requests: int = 10_000, nodes: int = 4, capacity: int = 8, per_tick: int = 100,
             latency_ticks: int = 3, builder: LogBuilder | None = None) -> LogBuilder:
    """A mixed log: ``requests`` start/finish pairs over ``nodes`` nodes, a tick every
    ``per_tick`` requests, engine samples, a capacity drop of n0 to 1 a third of the way in and
    an operator drain of the last node at two thirds (then undrained)."""
    log = builder or LogBuilder()
    names = [f"n{i}" for i in range(nodes)]
    for name in names:
        log.node(name, capacity)
    log.tick()
    open_ids: list[tuple[int, str, str]] = []
    for r in range(requests):
        if r == requests // 3:
            log.add(sj.admin_capacity(names[0]), {"capacity": 1})
        if r == 2 * requests // 3:
            log.add(sj.admin_drain(names[-1]))
        if r == 2 * requests // 3 + 3 * per_tick:
            log.add(sj.admin_undrain(names[-1]))
        view = {n.node: n for n in log.scheduler.snapshot("default").nodes}
        routable = [n for n in names if view[n].routable and view[n].effective_weight > 0] or names[:1]
        node = routable[r % len(routable)]
        log.started(node, f"r{r}", snapshot_seq=log.last_snapshot_seq(), after_ms=0.05)
        open_ids.append((r, node, f"r{r}"))
        while open_ids and open_ids[0][0] <= r - latency_ticks * per_tick:
            _, done_node, request_id = open_ids.pop(0)
            log.finished(done_node, request_id, after_ms=0.05)
        if r % per_tick == per_tick - 1:
            log.tick(after_ms=1.0)
            for name in names:
                log.add(sj.metrics_engine(name), {"running": 2, "waiting": 0, "kv_cache_usage": 0.3,
                                                  "ttft_ms": 40.0}, after_ms=0.1)
    for _, done_node, request_id in open_ids:
        log.finished(done_node, request_id, after_ms=0.05)
    log.tick()
    return log
