"""Forwarding one client request to its engines: the driver of ``scheduler.routing.attempts``.

``Forwarder.forward`` runs the request's attempts (``services.proxy.attempt``: one attempt on one
engine; ``services.proxy.pairs``: a P/D pool's legs) and, after each, does what the attempts table
says for its leg, outcome and the budget left: retry on another node, continue on another node, a
new pair, or give up. Rules ("never cut", docs/proxy.md, "Streams that survive their engine"):

* The upstream URL is bound when the request is admitted (``scheduler.routing.router.Admission``); nothing that
  happens to snapshots afterwards reaches an admitted request.
* An attempt may be retried on another node (never one already tried) only while **no byte has
  reached the client**: on a connection failure, a timeout, a 5xx status, or a body that breaks
  before its first chunk. The client response is prepared only when the first body chunk is in
  hand, so "headers arrived, then the engine died" is still retryable. At most ``max_retries``
  retries; when none is left (or no untried node remains) the last failure is answered: the
  engine's own 5xx passes through, a connection failure becomes 502, a timeout 504.
* After the first byte a break (connection reset, an engine error event, an undecodable event,
  the stream ending before its finish, or no byte for ``stall_timeout_s``) of a continuable
  stream is **continued**: the proxy admits another node (never one already tried, through the
  normal policy), sends it the continuation request of ``scheduler.routing.continuation`` and goes
  on writing the same SSE response; the broken attempt's outcome is ``continued`` and names
  the next attempt. At most ``continue_limit`` continuations per request (0: none); a
  continuation that fails before its first event is retried like any attempt (``max_retries``),
  one answered with anything but SSE (e.g. a 4xx from an engine without the continuation
  options) is not.
* Otherwise (not continuable, no continuation left, or no untried node) a failure after the
  first byte ends the SSE stream with ``data: {"error": {...}}`` (its message says why it was
  not continued) and the outcome ``upstream_error``; the client gets what it was sent up to the cut.
* A continuable SSE stream is forwarded in whole events (the client never holds half an event
  when an engine dies; the whole events of one engine read go out in one write), each event read
  for the text so far; any other stream is
  written chunk by chunk as read. Every write is awaited (backpressure). Other answers (JSON)
  are read whole first, which keeps them retryable to the last byte (a non-streamed request
  is retried whole) and lets the proxy read ``usage``.
* Engine response headers pass through, minus hop-by-hop ones and the length (the proxy
  re-frames); ``x-laswrr-node`` names the node. Bodies pass byte for byte (no decompression).
  Redirects pass through to the client too (never followed), and the engine transport
  (``services.proxy.transport``; its implementation ``services.proxy.engine_client``) keeps no
  cookies: one client's ``Set-Cookie`` must never reach another client's request.
* Client gone (aiohttp cancels the handler, or a write fails) -> the upstream response is
  closed, which cancels the engine's work; outcome ``client_cancelled``. A cancel during
  shutdown after the grace period is ``router_aborted``.

Events: one started/finished pair per attempt (see ``services.proxy.events``); attempt k of a
request is ``attempts.attempt_id(request_id, k)``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from laswrr.schemas.refusals import ANSWERS
from laswrr.schemas.words import NodeRole, PdProtocol, RefusalCause, RequestOutcome
from laswrr.scheduler.routing.attempts import (
    ANSWER,
    CONTINUATIONS,
    WHOLE,
    Budget,
    Decision,
    GiveUp,
    Leg,
    Outcome,
    Step,
    attempt_id,
    decide,
    give_up_text,
    next_leg,
    pair_leg,
)
from laswrr.scheduler.routing.router import AdmitRequest, Admission, Router
from laswrr.services.proxy.answers import (
    REQUEST_ID_HEADER,
    error_body,
    error_response,
    forward_headers,
    sse_error,
    tag,
    usage_from_json,
    usage_from_sse,
)
from laswrr.services.proxy.attempt import AttemptRunner, NodeModels
from laswrr.services.proxy.events import Attempt, EventPublisher
from laswrr.services.proxy.exchange import Broken, Done, Exchange, Failed, Result, ms, outcome_of
from laswrr.services.proxy.metrics import ProxyMetrics
from laswrr.services.proxy.pairs import SglangPair, vllm_prefill
from laswrr.services.proxy.transport import EngineTransport

__all__ = ["Forwarder", "Exchange", "NodeModels", "REQUEST_ID_HEADER", "error_body", "error_response",
           "forward_headers", "usage_from_json", "usage_from_sse"]


@dataclass(slots=True)
class Course:
    """Where one client request is in its attempts."""

    budget: Budget
    leg: Leg
    admission: Admission  # the current attempt's node
    decode: Admission | None = None  # a pair's decode node, while its prefill leg runs (or starts)
    number: int = 0  # the current attempt's number
    leg_body: bytes | None = None  # a decode leg's body (vllm: with the prefill's kv_transfer_params; sglang: bootstrap)
    suspect: list[str] = field(default_factory=list)  # prefill nodes of sglang pairs whose decode leg failed beside them


class Forwarder:
    def __init__(self, engines: EngineTransport, router: Router, events: EventPublisher,
                 metrics: ProxyMetrics, max_retries: int,
                 aborting: Callable[[], bool], continue_limit: int = 1, stall_timeout_s: float = 30.0,
                 catalog: NodeModels | None = None, decode_only_tokens: int = 0,
                 picked: Callable[[], None] = lambda: None) -> None:
        self.runner = AttemptRunner(engines, router, events, metrics, aborting, continue_limit, stall_timeout_s,
                                    catalog)
        self.sglang = SglangPair(self.runner)
        self.router = router
        self.events = events
        self.metrics = metrics
        self.continue_limit = continue_limit
        self.budget = Budget(max_retries, continue_limit)  # a request's, none spent (immutable: shared)
        self.decode_only_tokens = decode_only_tokens  # a vllm pair's short prompt: its decode node alone (0: off)
        self.picked = picked  # tells the bus a pick was made (the channel's pick window starts at once)

    async def forward(self, request: web.BaseRequest, exchange: Exchange, admission: Admission) -> web.StreamResponse:
        """Run attempts until one answers, or retries and continuations run out; ``admission`` is
        the first node (in a P/D pool, the first pair's prefill node)."""
        course = self._first(exchange, admission)
        if not isinstance(course, Course):
            return course
        while True:
            result = await self._attempt(request, exchange, course)
            outcome = Outcome.DONE if isinstance(result, bytes) else outcome_of(result)
            if isinstance(result, Failed) and result.partner:
                exchange.tried.remove(course.admission.node)  # cancelled for its prefill's failure: the node may serve
            decision = decide(course.leg, outcome, course.budget)
            if decision.step is ANSWER:
                assert isinstance(result, Done)
                return result.response
            if decision.step is Step.DECODE:  # a vllm prefill leg answered: ``result`` is the decode leg's body
                assert isinstance(result, bytes) and course.decode is not None
                course.leg, course.admission, course.decode = Leg.DECODE, course.decode, None
                course.leg_body, course.number = result, course.number + 1
                continue
            assert isinstance(result, (Failed, Broken))
            answer = await self._take_over(exchange, course, result, outcome, decision)
            if answer is not None:
                return answer

    def _first(self, exchange: Exchange, admission: Admission) -> Course | web.StreamResponse:
        """The first attempt: on a whole node, a vllm pair's decode node alone, or a pair (its decode node picked here)."""
        if admission.role is None:  # a whole node
            return Course(self.budget, WHOLE, admission)
        if admission.role == NodeRole.PREFILL and self._decode_only(admission):
            alone = self._admit(exchange, None, NodeRole.DECODE)
            if alone is not None:  # none: the pair's own refusal below answers
                self.router.admitter.release(admission)
                admission = alone
        course = Course(self.budget, Leg.WHOLE, admission)
        if admission.role == NodeRole.DECODE:
            course.leg = Leg.DECODE
        elif admission.role == NodeRole.PREFILL:
            course.leg, course.decode = pair_leg(admission.protocol), self._admit(exchange, None, NodeRole.DECODE)
            if course.decode is None:
                self.router.admitter.release(admission)
                message = f"no routable decode node in pool {exchange.pool} for the prefill/decode pair"
                cause = RefusalCause.NO_ROUTABLE_NODE
                answer = ANSWERS[cause]
                self.events.refused(exchange.request_id, answer.status, cause, message,
                                    pool=exchange.pool, key_name=exchange.key_name)
                return error_response(answer.status, message, answer.type, answer.code,
                                      headers={REQUEST_ID_HEADER: exchange.request_id})
        return course

    def _decode_only(self, admission: Admission) -> bool:
        """A vllm pair's request short enough for its decode node to prefill alone (``decode_only_tokens``)."""
        return (admission.protocol == PdProtocol.VLLM and self.decode_only_tokens > 0 and admission.size is not None
                and admission.size.prompt_tokens <= self.decode_only_tokens)

    def _attempt(self, request: web.BaseRequest, exchange: Exchange, course: Course) -> Awaitable[Result | bytes]:
        """Start the course's current attempt (a pair's: its prefill leg, or both legs): what to
        await for its result (a plain function returning the runner's coroutine: one coroutine
        frame less for each of the attempt's awaits)."""
        rid, admission, leg = exchange.request_id, course.admission, course.leg
        if leg is not WHOLE and leg is not Leg.DECODE:
            return self._pair_legs(request, exchange, course)
        exchange.tried.append(admission.node)
        body = course.leg_body if course.leg_body is not None and leg is Leg.DECODE else exchange.base
        attempt = attempt_id(rid, course.number)
        state = self.runner.started(attempt, admission, exchange)
        return self.runner.run(request, exchange, admission, attempt, body, state)

    def _pair_legs(self, request: web.BaseRequest, exchange: Exchange, course: Course) -> Awaitable[Result | bytes]:
        """``_attempt`` of a new pair: a vllm pair's prefill leg, or an sglang pair's legs together."""
        rid, admission = exchange.request_id, course.admission
        assert course.decode is not None
        exchange.headers.setdefault("X-Request-Id", rid)  # one id for both legs (vLLM's KV lookup)
        if course.leg is Leg.PREFILL:
            return vllm_prefill(self.runner, exchange, admission, course.decode, attempt_id(rid, course.number))
        leg, course.leg_body = self.sglang.start(exchange, admission, attempt_id(rid, course.number))
        course.admission, course.decode, course.number = course.decode, None, course.number + 1
        exchange.tried.append(course.admission.node)
        return self.sglang.run(request, exchange, leg, course.admission, attempt_id(rid, course.number),
                               course.leg_body, course.suspect)

    async def _take_over(self, exchange: Exchange, course: Course, result: Failed | Broken, outcome: Outcome,
                         decision: Decision) -> web.StreamResponse | None:
        """Record the failed or broken attempt and start what the decision says; the answer when it gives up."""
        step, cause = decision.step, decision.cause
        if course.leg is Leg.PREFILL:
            exchange.tried.append(course.admission.node)
        taker = decode = None
        if step is not Step.GIVE_UP:
            taker, decode = self._admit_for(exchange, course, step)
            if taker is None:
                step, cause = Step.GIVE_UP, GiveUp.NO_NODE
        attempt = _failed_record(exchange, result, taker is not None)
        if taker is not None:
            attempt.next_attempt = attempt_id(exchange.request_id, course.number + 1)
        self.runner.finish(attempt_id(exchange.request_id, course.number), course.admission, exchange, attempt)
        if taker is None:
            assert cause is not None
            if course.decode is not None:  # a vllm pair's prefill leg: its decode node never ran
                self.router.admitter.release(course.decode)
            why = give_up_text(course.leg, outcome, cause, self.continue_limit)
            return await self._give_up(result, course.admission, exchange, why)
        course.budget = course.budget.spend(step)
        (self.metrics.continuations if step in CONTINUATIONS else self.metrics.retries).labels(pool=exchange.pool).inc()
        course.leg, course.admission, course.number = next_leg(step, course.leg, taker.protocol), taker, course.number + 1
        if decode is not None:  # a new pair (a retried prefill leg keeps its pair's decode node)
            course.decode = decode
        return None

    def _admit_for(self, exchange: Exchange, course: Course, step: Step) -> tuple[Admission | None, Admission | None]:
        """The node that takes over, and a new pair's decode node (neither when no pair can be made)."""
        if step is Step.RETRY:  # the same role: a vllm decode leg on another decode node, with the same KV params
            return self._admit(exchange, course.suspect, NodeRole.DECODE if course.leg is Leg.DECODE else None), None
        taker = self._admit(exchange, course.suspect, None)
        if taker is None or taker.role != NodeRole.PREFILL:
            return taker, None
        decode = self._admit(exchange, None, NodeRole.DECODE)
        if decode is None:
            self.router.admitter.release(taker)
            return None, None
        return taker, decode

    def _admit(self, exchange: Exchange, suspect: list[str] | None, role: NodeRole | None) -> Admission | None:
        """The one call of the admitter: a node of ``role`` not tried yet; a new sglang pair avoids
        the ``suspect`` prefill nodes while another prefill node can serve (the decode's failure may
        have been its bootstrap with a prefill engine that died), else takes them again."""
        admitter = self.router.admitter
        if suspect and role is None:
            admission = admitter.admit(AdmitRequest(exchange.pool, [*exchange.avoid(), *suspect]))
            if isinstance(admission, Admission):
                self.picked()
                return admission
        objective = exchange.objective if role is NodeRole.DECODE else None  # a pair's decode pick: its TPOT target
        result = admitter.admit(AdmitRequest(exchange.pool, exchange.avoid(), role=role, objective=objective))
        if not isinstance(result, Admission):
            return None
        self.picked()
        return result

    async def _give_up(self, result: Failed | Broken, admission: Admission, exchange: Exchange,
                       why: str) -> web.StreamResponse:
        """No attempt is left: answer the last failure, or end the client's stream with an error event."""
        client = exchange.client
        if client is None:
            assert isinstance(result, Failed)
            return tag(result.to_response(admission.node), admission.node, exchange.request_id)
        reason = result.reason if isinstance(result, Failed) else result.attempt.error
        try:
            await client.response.write(sse_error(f"upstream node {admission.node} failed mid-stream: {reason} "
                                                  f"(not continued: {why})"))
            await client.response.write_eof()
        except (ConnectionResetError, RuntimeError):  # the client may be gone too
            pass
        return client.response


def _failed_record(exchange: Exchange, result: Failed | Broken, taken_over: bool) -> Attempt:
    """The finished event of a failed or broken attempt; ``taken_over``: another attempt follows it."""
    if isinstance(result, Broken):
        if taken_over:
            result.attempt.outcome = RequestOutcome.CONTINUED
        return result.attempt
    return Attempt(outcome=result.outcome(), status=result.status,
                   duration_ms=ms(time.perf_counter() - exchange.arrived), error=result.error(taken_over))
