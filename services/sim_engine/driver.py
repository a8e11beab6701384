"""Asyncio driver of the simulated engine: one stepping task per engine.

Runs the pure ``EngineSim`` against the event loop's monotonic clock: it sleeps until the
next step ends (or until a submit/cancel/admin change kicks it), advances the physics, and
pushes each produced token into the owning request's ``asyncio.Queue`` (unbounded, so a slow
client just buffers tokens). It also feeds the Prometheus metrics, and with a KV event publisher
(``--kv-events``) publishes the blocks each advance stored and evicted as one batch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from laswrr.services.sim_engine.kv_publisher import KvEventPublisher
from laswrr.services.sim_engine.metrics import SimMetrics
from laswrr.services.sim_engine.physics import EngineSim, EngineSnapshot, SimRequest, TokenEvent


@dataclass(slots=True)
class RequestHandle:
    """A submitted request as the HTTP handler sees it."""

    req: SimRequest
    finish_reason: str
    queue: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)
    last_token_at: float | None = None


class EngineDriver:
    def __init__(self, sim: EngineSim, metrics: SimMetrics, kv_events: KvEventPublisher | None = None) -> None:
        self.sim = sim
        self.metrics = metrics
        self.kv_events = kv_events
        self._handles: dict[int, RequestHandle] = {}
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()

    def now(self) -> float:
        return self._loop.time()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="sim-engine-stepper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def submit(self, prompt_tokens: int, output_tokens: int, finish_reason: str,
               prompt_text: str = "", kv_received: bool = False,
               token_ids: Sequence[int] | None = None) -> RequestHandle:
        """Queue a request (ValueError if it can never fit); tokens arrive on handle.queue."""
        req = self.sim.submit(prompt_tokens, output_tokens, self.now(), prompt_text, kv_received, token_ids)
        handle = RequestHandle(req, finish_reason)
        self._handles[req.req_id] = handle
        self._kick.set()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Abort a request (client gone or fault injected): frees its slot and KV now."""
        self._handles.pop(handle.req.req_id, None)
        if self.sim.cancel(handle.req.req_id) is not None:
            self._kick.set()

    def kick(self) -> None:
        """Re-plan after a knob changed (capacity, slowdown)."""
        self._kick.set()

    def snapshot(self) -> EngineSnapshot:
        return self.sim.snapshot(self.now())

    async def _run(self) -> None:
        while True:
            self._kick.clear()
            self._dispatch(self.sim.advance(self.now()))
            if self.kv_events is not None:
                self.kv_events.publish(self.sim.prefix_cache.take_events(), self.sim.params.kv_block_tokens)
            wake_at = self.sim.next_event_time()
            timer = None if wake_at is None else self._loop.call_at(wake_at, self._kick.set)
            try:
                await self._kick.wait()
            finally:
                if timer is not None:
                    timer.cancel()

    def _dispatch(self, events: list[TokenEvent]) -> None:
        for event in events:
            handle = self._handles.get(event.req_id)
            if handle is None:
                continue
            self._account(handle, event)
            handle.queue.put_nowait(event)
            if event.finished:
                del self._handles[event.req_id]

    def _account(self, handle: RequestHandle, event: TokenEvent) -> None:
        gap = None if handle.last_token_at is None else event.time - handle.last_token_at
        handle.last_token_at = event.time
        if event.index == 0:
            self.metrics.on_first_token(handle.req)
        self.metrics.on_token(gap)
        if event.finished:
            self.metrics.on_finished(handle.req, handle.finish_reason)
