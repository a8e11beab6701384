"""Continuous-batching physics of one simulated inference engine (pure: time is an argument).

What it models (vLLM-style continuous batching with chunk-free mixed steps):

* ``capacity`` concurrent decode slots; new requests wait in a FIFO queue (head-of-line:
  if the head cannot start, nobody behind it starts);
* a request first spends a fixed front-end time (tokenise/schedule) before it can be
  scheduled; it is *waiting* only once that is over;
* the engine runs back-to-back steps; at each step boundary it admits waiting requests while
  a slot is free and the KV budget can hold the request's prompt plus its whole output
  (conservative, MindIE-style reservation: no preemption ever happens);
* a step lasts ``decode_step_s(batch) + prefill_s(prompt tokens admitted this step)``, times
  ``slowdown / speed``; every request in the step's batch gets one token at its end (the
  newly admitted ones get their first token, so TTFT = queue + front-end + prefill + 1 step);
* TPOT grows with the batch: ``base_tpot / decode_speed * (1 + growth * (n - 1) / ref)``
  where ``ref`` is the chip's ``base_capacity`` (hardware batch scale, not the admission
  limit, so tokens/s still rise with the batch at any capacity): ~32 ms alone, ~150 ms
  with 10 running on a 910B (docs/ascend.md §3, light/saturated anchors);
* KV use = tokens held by running requests (prompt + generated, rounded up to 16-token
  blocks) / the chip's KV room;
* prefix caching (``prefix_cache``): a request submitted with its prompt text looks its
  prompt's 16-token blocks up when it is admitted; the cached prefix skips prefill (the step
  pays only the rest), the blocks it computed are cached at the end of its prefill step, and the
  cache keeps unreferenced blocks in the KV room the running requests' reservations leave free
  (least recently released evicted first); cached blocks do not count as KV use (vLLM counts
  them free); with ``kv_events`` the cache logs the blocks it stores and evicts, with their
  token ids (``PrefixCache.take_events``), what a vLLM engine's KV events tell; a request
  submitted with ``token_ids`` (the model's tokenizer's, ``--tokenizer``) is cut into blocks of
  those instead of the simulator's own ids of its text;
* lowering ``capacity`` never cuts running requests; it only stops admissions until the batch
  falls below the new value; a cancelled request frees its slot and KV at once.

The driver calls ``advance(now)`` at ``next_event_time()`` (and after each submit/cancel) and
forwards the returned ``TokenEvent``s to the clients.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from laswrr.schemas.kvcache import chain_keys
from laswrr.services.sim_engine.prefix_cache import PrefixCache, block_keys, token_ids as text_token_ids
from laswrr.services.sim_engine.profiles import (
    BASE_PREFILL_TOKENS_PER_S,
    BASE_TPOT_S,
    FRONTEND_OVERHEAD_S,
    TPOT_GROWTH,
    ChipProfile,
)

KV_BLOCK_TOKENS = 16


@dataclass(frozen=True, slots=True)
class PhysicsParams:
    """The 910B3-baseline constants; chip profiles scale them."""

    base_tpot_s: float = BASE_TPOT_S
    prefill_tokens_per_s: float = BASE_PREFILL_TOKENS_PER_S
    frontend_s: float = FRONTEND_OVERHEAD_S
    tpot_growth: float = TPOT_GROWTH
    kv_block_tokens: int = KV_BLOCK_TOKENS


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"


@dataclass(slots=True)
class SimRequest:
    """One request's life in the engine (all times on the caller's clock)."""

    req_id: int
    prompt_tokens: int
    output_tokens: int
    arrival: float
    ready_at: float
    state: RequestState = RequestState.WAITING
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    generated: int = 0
    block_keys: tuple[int, ...] = ()  # prefix-chain keys of the prompt's full blocks
    token_ids: tuple[int, ...] = ()  # the prompt's token ids (kept only for the KV event log)
    held_blocks: int = 0  # leading block_keys this request references in the prefix cache
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    kv_received: bool = False  # a P/D decode instance's request: its prompt's KV came from a prefill node

    @property
    def kv_reserve(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def done(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.CANCELLED)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """Token number ``index`` (0-based) of request ``req_id`` was produced at ``time``."""

    req_id: int
    index: int
    time: float
    finished: bool


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    running: int
    waiting: int
    capacity: int
    kv_tokens_used: int
    kv_tokens_total: int
    busy: bool
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of which were cached

    @property
    def kv_usage(self) -> float:
        return self.kv_tokens_used / self.kv_tokens_total if self.kv_tokens_total else 0.0


@dataclass(slots=True)
class _Step:
    start: float
    end: float
    batch: list[int] = field(default_factory=list)


class EngineSim:
    """Discrete-event model of one engine; see the module docstring for the rules."""

    def __init__(
        self,
        profile: ChipProfile,
        capacity: int,
        *,
        speed: float = 1.0,
        kv_tokens: int | None = None,
        params: PhysicsParams | None = None,
        kv_events: bool = False,
    ) -> None:
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        self.profile = profile
        self.params = params or PhysicsParams()
        self.speed = speed
        self.kv_tokens_total = int(kv_tokens if kv_tokens is not None else profile.kv_tokens)
        if self.kv_tokens_total <= 0:
            raise ValueError(f"kv_tokens must be > 0, got {self.kv_tokens_total}")
        self._capacity = 0
        self.set_capacity(capacity)
        self._slowdown = 1.0
        self._next_id = 0
        self._waiting: deque[SimRequest] = deque()
        self._running: dict[int, SimRequest] = {}
        self._kv_reserved = 0
        self.prefix_cache = PrefixCache(self.params.kv_block_tokens, log_changes=kv_events)
        self._step: _Step | None = None
        self._clock = 0.0  # end of the last step (the engine is free from here on)
        self.steps = 0
        self.tokens_generated = 0
        self.requests_finished = 0

    # -- knobs -------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    def set_capacity(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._capacity = int(capacity)

    @property
    def slowdown(self) -> float:
        return self._slowdown

    def set_slowdown(self, factor: float) -> None:
        if not factor > 0:
            raise ValueError(f"slowdown must be > 0, got {factor}")
        self._slowdown = float(factor)

    # -- timing model ------------------------------------------------------------------
    def decode_step_s(self, batch: int) -> float:
        """Unscaled time of one decode step with ``batch`` running requests."""
        if batch <= 0:
            return 0.0
        load = (batch - 1) / self.profile.base_capacity
        base = self.params.base_tpot_s / self.profile.decode_speed
        return base * (1.0 + self.params.tpot_growth * load)

    def prefill_s(self, tokens: int) -> float:
        """Unscaled time to prefill ``tokens`` prompt tokens."""
        return tokens / (self.params.prefill_tokens_per_s * self.profile.prefill_speed)

    def _scale(self, seconds: float) -> float:
        return seconds * self._slowdown / self.speed

    # -- requests ----------------------------------------------------------------------
    def submit(self, prompt_tokens: int, output_tokens: int, now: float, prompt_text: str = "",
               kv_received: bool = False, token_ids: Sequence[int] | None = None) -> SimRequest:
        """Queue a request; ValueError if it can never fit in the KV cache. ``prompt_text``
        (optional) is what the prefix cache hashes; without it the request never hits;
        ``token_ids`` (optional) its model tokens, hashed instead of the text's simulator ids.
        ``kv_received``: its prompt's KV was transferred from a prefill instance (P/D decode): it
        holds its KV but its first step computes no prefill."""
        if prompt_tokens < 1 or output_tokens < 1:
            raise ValueError("prompt_tokens and output_tokens must be >= 1")
        if prompt_tokens + output_tokens > self.kv_tokens_total:
            raise ValueError(
                f"prompt ({prompt_tokens}) + output ({output_tokens}) tokens exceed the "
                f"KV cache ({self.kv_tokens_total} tokens)"
            )
        self._next_id += 1
        ready_at = now + self.params.frontend_s / self.speed
        block = self.params.kv_block_tokens
        ids = (text_token_ids(prompt_text) if token_ids is None else tuple(token_ids))[:prompt_tokens // block * block]
        req = SimRequest(self._next_id, prompt_tokens, output_tokens, now, ready_at,
                         block_keys=tuple(chain_keys(ids, block)),
                         token_ids=ids if self.prefix_cache.changes is not None else (), kv_received=kv_received)
        self._waiting.append(req)
        return req

    def cancel(self, req_id: int) -> SimRequest | None:
        """Drop a waiting or running request, freeing its slot and KV; None if not live."""
        req = self._running.pop(req_id, None)
        if req is not None:
            self._kv_reserved -= req.kv_reserve
            self._release_blocks(req)
        else:
            req = next((r for r in self._waiting if r.req_id == req_id), None)
            if req is None:
                return None
            self._waiting.remove(req)
        req.state = RequestState.CANCELLED
        return req

    # -- stepping ----------------------------------------------------------------------
    def next_event_time(self) -> float | None:
        """When ``advance`` next has work (may be in the past); None when idle for good."""
        if self._step is not None:
            return self._step.end
        return self._next_start_time()

    def advance(self, now: float) -> list[TokenEvent]:
        """Run every step that ends at or before ``now``; start the next one if due."""
        events: list[TokenEvent] = []
        while True:
            if self._step is not None:
                if self._step.end > now:
                    break
                events.extend(self._finish_step())
                continue
            start = self._next_start_time()
            if start is None or start > now or not self._begin_step(start):
                break
        return events

    def _next_start_time(self) -> float | None:
        if self._running:
            return self._clock
        if self._waiting and self._can_admit(self._waiting[0]):
            return max(self._clock, self._waiting[0].ready_at)
        return None

    def _can_admit(self, req: SimRequest) -> bool:
        return (
            len(self._running) < self._capacity
            and self._kv_reserved + req.kv_reserve <= self.kv_tokens_total
        )

    def _admit_ready(self, t: float) -> int:
        prefill_tokens = 0
        while self._waiting and self._waiting[0].ready_at <= t and self._can_admit(self._waiting[0]):
            req = self._waiting.popleft()
            req.state = RequestState.RUNNING
            req.admitted_at = t
            self._running[req.req_id] = req
            self._kv_reserved += req.kv_reserve
            req.held_blocks, req.cached_tokens = self.prefix_cache.admit(req.block_keys, req.prompt_tokens)
            if not req.kv_received:
                prefill_tokens += req.prompt_tokens - req.cached_tokens
        self.prefix_cache.evict_to(self.kv_tokens_total - self._kv_reserved)
        return prefill_tokens

    def _register_blocks(self, req: SimRequest) -> None:
        """End of the request's prefill step: the blocks it computed join the cache."""
        held = req.held_blocks
        parent = req.block_keys[held - 1] if held else None
        self.prefix_cache.acquire(req.block_keys[held:], req.token_ids, parent, held)
        req.held_blocks = len(req.block_keys)
        self.prefix_cache.evict_to(self.kv_tokens_total - self._kv_reserved)

    def _release_blocks(self, req: SimRequest) -> None:
        self.prefix_cache.release(req.block_keys[:req.held_blocks])
        req.held_blocks = 0

    def _begin_step(self, t: float) -> bool:
        prefill_tokens = self._admit_ready(t)
        if not self._running:
            return False
        duration = self._scale(self.decode_step_s(len(self._running)) + self.prefill_s(prefill_tokens))
        self._step = _Step(t, t + duration, list(self._running))
        return True

    def _finish_step(self) -> list[TokenEvent]:
        step = self._step
        assert step is not None
        self._step = None
        self._clock = step.end
        self.steps += 1
        events: list[TokenEvent] = []
        for req_id in step.batch:
            req = self._running.get(req_id)
            if req is None:  # cancelled during the step
                continue
            events.append(self._emit_token(req, step.end))
        return events

    def _emit_token(self, req: SimRequest, t: float) -> TokenEvent:
        req.generated += 1
        self.tokens_generated += 1
        if req.first_token_at is None:
            req.first_token_at = t
            self._register_blocks(req)
        finished = req.generated >= req.output_tokens
        if finished:
            req.state = RequestState.FINISHED
            req.finished_at = t
            del self._running[req.req_id]
            self._kv_reserved -= req.kv_reserve
            self._release_blocks(req)
            self.requests_finished += 1
        return TokenEvent(req.req_id, req.generated - 1, t, finished)

    # -- observation -------------------------------------------------------------------
    def first_token_eta(self, prompt_tokens: int, prompt_text: str, now: float) -> float:
        """When a request submitted ``now`` would get its first token, if it were admitted at the
        next step boundary together with every request waiting (an estimate: it ignores the KV
        check, and a full batch waits one decode step per request over the capacity). For a
        reference router that reads the engine's exact state (``bench.virtual``)."""
        block = self.params.kv_block_tokens
        cache = self.prefix_cache
        prefill = prompt_tokens - cache.match(block_keys(prompt_text, block, prompt_tokens // block)) * block
        prefill += sum(r.prompt_tokens - cache.match(r.block_keys) * block for r in self._waiting)
        batch = len(self._running) + len(self._waiting) + 1
        start = max(now + self.params.frontend_s / self.speed, self._step.end if self._step else now)
        step = self._scale(self.decode_step_s(batch))
        return start + step * max(0, batch - self._capacity) + step + self._scale(self.prefill_s(prefill))

    def kv_tokens_used(self) -> int:
        block = self.params.kv_block_tokens
        return sum(
            math.ceil((r.prompt_tokens + r.generated) / block) * block for r in self._running.values()
        )

    def snapshot(self, now: float) -> EngineSnapshot:
        waiting = sum(1 for r in self._waiting if r.ready_at <= now)
        return EngineSnapshot(
            running=len(self._running),
            waiting=waiting,
            capacity=self._capacity,
            kv_tokens_used=self.kv_tokens_used(),
            kv_tokens_total=self.kv_tokens_total,
            busy=self._step is not None,
            prefix_cache_queries=self.prefix_cache.queries,
            prefix_cache_hits=self.prefix_cache.hits,
        )
