"""Test helper: feed events into a pure ``Scheduler`` the way the stream would.

``Feed`` stamps each input with the next stream sequence and an event time that only advances
when a test says so (``dt_ms``, ``tick``), builds subjects with ``schemas.subjects`` and
payloads as plain JSON, and decodes outputs back into dicts for assertions. No fixtures: a
test creates a ``Feed`` and reads whole states and snapshots.
"""

from __future__ import annotations

import json
from typing import Any

from laswrr.scheduler.config import SchedulerConfig
from laswrr.scheduler.core import Scheduler
from laswrr.scheduler.state import NodeState
from laswrr.schemas import subjects as sj
from laswrr.schemas.codec import Envelope, Output, encode

T0 = 1_700_000_000_000_000_000
MS = 1_000_000


class Feed:
    def __init__(self, config: SchedulerConfig | None = None, scheduler: Scheduler | None = None) -> None:
        self.scheduler = scheduler or Scheduler(config)
        self.seq = 0
        self.ts_ns = T0
        self.tick_no = 0
        self.request_no = 0
        self.log: list[Envelope] = []

    # -- raw --------------------------------------------------------------------------------

    def send(self, subject: str, payload: Any = None, dt_ms: int = 0) -> list[Output]:
        self.seq += 1
        self.ts_ns += dt_ms * MS
        data = payload if isinstance(payload, bytes) else json.dumps(payload if payload is not None else {}).encode()
        envelope = Envelope(self.seq, self.ts_ns, subject, data)
        self.log.append(envelope)
        return self.scheduler.apply(envelope)

    # -- admin --------------------------------------------------------------------------------

    def register(self, node: str, capacity: int = 10, pool: str = "default", dt_ms: int = 0) -> list[Output]:
        return self.send(sj.admin_node(node), {"url": f"http://{node}:8000", "pool": pool, "chip": "910B",
                                               "capacity": capacity}, dt_ms)

    def capacity(self, node: str, capacity: int, dt_ms: int = 0) -> list[Output]:
        return self.send(sj.admin_capacity(node), {"capacity": capacity}, dt_ms)

    def drain(self, node: str) -> list[Output]:
        return self.send(sj.admin_drain(node))

    def undrain(self, node: str) -> list[Output]:
        return self.send(sj.admin_undrain(node))

    def remove(self, node: str) -> list[Output]:
        return self.send(sj.admin_remove(node))

    def config(self, **changes: Any) -> list[Output]:
        return self.send(sj.ADMIN_CONFIG, {"set": changes})

    # -- signals ------------------------------------------------------------------------------

    def engine(self, node: str, running: int = 0, waiting: int = 0, kv: float = 0.0,
               ttft_ms: float | None = None, dt_ms: int = 0) -> list[Output]:
        payload: dict[str, Any] = {"running": running, "waiting": waiting, "kv_cache_usage": kv}
        if ttft_ms is not None:
            payload["ttft_ms"] = ttft_ms
        return self.send(sj.metrics_engine(node), payload, dt_ms)

    def npu(self, node: str, health: str = "OK", util: float = 0.0, chips: int = 1) -> list[Output]:
        return self.send(sj.metrics_npu(node), {"chips": [
            {"npu_id": i, "chip_id": 0, "aicore_util": util, "hbm_used_mb": 1000, "hbm_total_mb": 65536,
             "health": health} for i in range(chips)]})

    def probe(self, node: str, ok: bool, error: str | None = None) -> list[Output]:
        payload: dict[str, Any] = {"ok": ok}
        if error:
            payload["error"] = error
        return self.send(sj.health(node), payload)

    # -- requests -----------------------------------------------------------------------------

    def start(self, node: str, proxy: str = "p1", request_id: str | None = None, boot: str | None = None,
              prompt_tokens: int | None = None, max_tokens: int | None = None, role: str | None = None) -> str:
        if request_id is None:
            self.request_no += 1
            request_id = f"r{self.request_no}"
        payload: dict[str, Any] = {"request_id": request_id, "proxy": proxy, "pool": "default"}
        if boot is not None:
            payload["boot_id"] = boot
        if role is not None:
            payload["role"] = role
        if prompt_tokens is not None:
            payload["prompt_tokens"] = prompt_tokens
        if max_tokens is not None:
            payload["max_tokens"] = max_tokens
        self.send(sj.req_started(node), payload)
        return request_id

    def finish(self, node: str, request_id: str, outcome: str = "completed", proxy: str = "p1",
               ttft_ms: float | None = None, boot: str | None = None, stream: bool | None = None) -> list[Output]:
        payload: dict[str, Any] = {"request_id": request_id, "proxy": proxy, "outcome": outcome}
        if ttft_ms is not None:
            payload["ttft_ms"] = ttft_ms
        if boot is not None:
            payload["boot_id"] = boot
        if stream is not None:
            payload["stream"] = stream
        return self.send(sj.req_finished(node), payload)

    def heartbeat(self, proxy: str, inflight: int = 0, boot: str | None = None,
                  snapshot_seq: int | None = None) -> list[Output]:
        payload: dict[str, Any] = {"inflight": inflight}
        if boot is not None:
            payload["boot_id"] = boot
        if snapshot_seq is not None:
            payload["snapshot_seq"] = snapshot_seq
        return self.send(sj.proxy_heartbeat(proxy), payload)

    # -- time ---------------------------------------------------------------------------------

    def tick(self, count: int = 1, period_ms: int = 100) -> list[Output]:
        outputs: list[Output] = []
        for _ in range(count):
            self.tick_no += 1
            outputs = self.send(sj.CLOCK_TICK, {"tick": self.tick_no}, period_ms)
        return outputs

    def ticks_until(self, ms: int, period_ms: int = 100) -> list[list[Output]]:
        """Tick every ``period_ms`` for ``ms`` of event time; every tick's outputs."""
        return [self.tick(1, period_ms) for _ in range(ms // period_ms)]

    # -- reading ------------------------------------------------------------------------------

    def node(self, name: str) -> NodeState:
        return self.scheduler.state.nodes[name]

    def phase(self, name: str) -> str:
        return self.scheduler.state.nodes[name].phase

    def snap(self, pool: str = "default") -> dict[str, Any]:
        return json.loads(encode(self.scheduler.snapshot(pool)))

    def view(self, name: str, pool: str = "default") -> dict[str, Any]:
        return next(n for n in self.snap(pool)["nodes"] if n["node"] == name)

    def checkpoint(self) -> bytes:
        return self.scheduler.checkpoint()


def decoded(outputs: list[Output]) -> list[tuple[str, dict[str, Any]]]:
    return [(o.subject, json.loads(o.data)) for o in outputs]


def rejections(outputs: list[Output]) -> list[str]:
    return [json.loads(o.data)["reason"] for o in outputs if o.subject == sj.OUT_REJECTED]


def phase_changes(outputs: list[Output]) -> list[tuple[str, str, str, str]]:
    return [(d["node"], d["from"], d["to"], d["reason"]) for s, d in decoded(outputs) if s.startswith(sj.OUT_PHASE + ".")]


def warm_pool(*names: str, capacity: int = 10, config: SchedulerConfig | None = None) -> Feed:
    """A pool registered at once (cold start: every node active) and ticked to steady weights."""
    feed = Feed(config)
    for name in names:
        feed.register(name, capacity)
    feed.tick(30)
    return feed


def idle_pool(*names: str) -> Feed:
    """``warm_pool`` with one idle engine and NPU sample per node, ticked once."""
    feed = warm_pool(*names)
    for name in names:
        feed.engine(name, running=0, waiting=0, kv=0.0)
        feed.npu(name, "OK", util=0.0)
    feed.tick()
    return feed
