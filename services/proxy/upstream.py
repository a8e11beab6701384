"""Forwarding one client request to an engine: admission, retries, streaming, continuation, outcomes.

Rules ("never cut", docs/proxy.md, "Streams that survive their engine"):

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

Events: one started/finished pair per attempt (see ``services.proxy.events``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from aiohttp import web
from multidict import CIMultiDict

from laswrr.schemas.words import NodeRole, PdProtocol, RefusalCause, RequestOutcome
from laswrr.scheduler.routing import pd
from laswrr.scheduler.routing.continuation import (
    Broken as EngineBroke,
    SseFramer,
    StreamText,
    continuation_body,
    not_continuable,
    route_kind,
)
from laswrr.services.proxy.events import RETRIED_PREFIX, Attempt, EventPublisher
from laswrr.services.proxy.metrics import ProxyMetrics
from laswrr.scheduler.routing.models import node_model
from laswrr.scheduler.routing.router import Admission, Router
from laswrr.services.proxy.transport import TRANSPORT_ERRORS, EngineReply, EngineTransport

NODE_HEADER = "x-laswrr-node"
REQUEST_ID_HEADER = "x-laswrr-request-id"
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})
REQUEST_DROP = tuple(HOP_BY_HOP | {"host", "content-length", "expect"})  # the body is already read
RESPONSE_DROP = tuple(HOP_BY_HOP | {"content-length"})
SSE_ERROR_TYPE = "upstream_error"
_TAIL_CHUNKS = 4
# an sglang pair whose decode leg ended: how long its prefill leg may still take to answer before it is cancelled
PREFILL_GRACE_S = 1.0


_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])  # a body's top level, values kept as their bytes


def with_model(body: bytes, model: str) -> bytes:
    """``body`` with its top-level ``model`` set to ``model``; every other value byte for byte."""
    fields = _FIELDS.decode(body)
    fields["model"] = msgspec.Raw(msgspec.json.encode(model))
    return msgspec.json.encode(fields)


def error_body(message: str, err_type: str, code: str | int | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "code": code, "param": None}}


def error_response(status: int, message: str, err_type: str, code: str | int | None,
                   headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(message, err_type, code), status=status, headers=headers)


class NodeModels(Protocol):
    """Where the forwarder finds a node's model ids the snapshot does not list (``models.ModelCatalog``)."""

    async def node_models(self, url: str) -> list[str]: ...


class ClientGone(Exception):
    """Writing to the client failed: it went away."""


@dataclass(slots=True)
class ClientStream:
    """The client's SSE response, once an attempt has started it; it outlives the attempt."""

    response: web.StreamResponse
    first_byte: float  # perf_counter when the response (its headers) went out
    text: StreamText | None  # what the client was sent, when the stream may be continued
    not_continuable: str | None  # why not, otherwise


@dataclass(slots=True)
class Exchange:
    """One client request as the forwarder sees it."""

    request_id: str
    pool: str
    path_qs: str
    method: str
    body: bytes
    headers: CIMultiDict[str]
    arrived: float  # perf_counter at handler entry
    tried: list[str] = field(default_factory=list)
    client: ClientStream | None = None
    continuation: bytes | None = None  # the body of the next attempt after a break
    key_name: str | None = None  # the client's API key, by name (lb.req.started)
    used_tokens: int | None = None  # prompt + completion tokens of the last attempt's usage (flow control's tpm)
    exclude: frozenset[str] = frozenset()  # nodes of the pool that do not list the request's model id
    alias: str | None = None  # the client's name for the model, forwarded as each attempt's node's own id
    leg_body: bytes | None = None  # a P/D decode leg's body (vllm: with the prefill's kv_transfer_params; sglang: bootstrap)
    pair: PairLeg | None = None  # an sglang pair's prefill leg, running beside its decode leg
    decoding: bool = False  # the current decode leg's first byte came: its KV is there, a prefill failure no longer matters
    partner_failed: Failed | None = None  # why the running decode leg is being cancelled (its prefill leg failed)
    suspect: list[str] = field(default_factory=list)  # prefill nodes of sglang pairs whose decode leg failed beside them

    def avoid(self) -> list[str]:
        """The nodes a retry or continuation may not go to: tried, or not serving the model."""
        return [*self.tried, *self.exclude] if self.exclude else self.tried


@dataclass(slots=True)
class AttemptState:
    """What one attempt has done so far; read by the caller when the attempt is cancelled."""

    started: float
    sent: float | None = None  # upstream request issued
    first_byte: float | None = None  # first byte of this attempt written to the client
    overhead: float = 0.0
    status: int | None = None  # the engine's status, once its answer's head is in


@dataclass(slots=True)
class Failed:
    """An attempt that failed before any byte of it reached the client (retryable unless said)."""

    reason: str
    status: int | None = None
    response: web.Response | None = None  # the engine's 5xx, passed through if no retry is left
    retryable: bool = True
    partner: bool = False  # a decode leg cancelled because its pair's prefill leg failed (its node is not at fault)

    def to_response(self, node: str) -> web.Response:
        if self.response is not None:
            return self.response
        if self.reason.startswith("timeout"):
            return error_response(504, f"upstream node {node} timed out: {self.reason}", SSE_ERROR_TYPE, "upstream_timeout")
        return error_response(502, f"upstream node {node} failed: {self.reason}", SSE_ERROR_TYPE, "upstream_unreachable")


@dataclass(slots=True)
class Broken:
    """A continuable stream that broke after the client got part of it; ``attempt`` is its record."""

    attempt: Attempt


@dataclass(slots=True)
class Done:
    response: web.StreamResponse
    attempt: Attempt


@dataclass(slots=True, eq=False)
class PairLeg:
    """An ``sglang`` pair's prefill leg: its own task, beside the decode leg the forwarder runs."""

    admission: Admission
    attempt_id: str
    state: AttemptState
    task: asyncio.Task[Failed | None] | None = None  # None: the leg completed; a Failed: why not
    cancel_reason: str | None = None  # set before the forwarder cancels it (its decode leg failed)


class Forwarder:
    def __init__(self, engines: EngineTransport, router: Router, events: EventPublisher,
                 metrics: ProxyMetrics, max_retries: int,
                 aborting: Callable[[], bool], continue_limit: int = 1, stall_timeout_s: float = 30.0,
                 catalog: NodeModels | None = None, decode_only_tokens: int = 0) -> None:
        self.engines = engines  # the engine transport (services/proxy/transport.py)
        self.router = router
        self.events = events
        self.metrics = metrics
        self.max_retries = max_retries
        self.aborting = aborting
        self.continue_limit = continue_limit
        self.stall_timeout_s = stall_timeout_s
        self.catalog = catalog  # model ids of nodes the snapshot has no list for
        self.decode_only_tokens = decode_only_tokens  # a vllm pair's short prompt: its decode node alone (0: off)

    async def forward(self, request: web.BaseRequest, exchange: Exchange, admission: Admission) -> web.StreamResponse:
        """Run attempts until one answers, or retries and continuations run out; ``admission`` is the first node.
        In a P/D pool it is a pair's prefill leg, and so is every admission that starts a new pair (a
        retried ``sglang`` pair, a broken stream continued): ``_pair`` runs it (``vllm``) or starts it
        beside the decode leg (``sglang``), and the decode leg is the attempt here."""
        attempt_no = retries = continuations = 0
        decode: Admission | None = None  # a new pair's decode node, admitted with its prefill node
        while True:
            if admission.role == NodeRole.PREFILL and attempt_no == 0 and self._decode_only(admission):
                alone = self.router.admit(exchange.pool, exchange.avoid(), role=NodeRole.DECODE)
                if alone is not None:  # none: the pair's own refusal below answers
                    self.router.release(admission)
                    admission = alone
            if admission.role == NodeRole.PREFILL:
                paired = await self._pair(exchange, admission, decode, attempt_no, retries)
                if not isinstance(paired, tuple):
                    return paired
                admission, attempt_no, retries = paired
            attempt_id = exchange.request_id if attempt_no == 0 else f"{exchange.request_id}.{attempt_no}"
            exchange.tried.append(admission.node)
            if exchange.pair is None:
                result = await self._attempt_with_events(request, exchange, admission, attempt_id)
            else:
                result = await self._paired_attempt(request, exchange, admission, attempt_id)
            if isinstance(result, Done):
                return result.response
            if isinstance(result, Failed) and result.partner:
                exchange.tried.remove(admission.node)  # cancelled for its prefill's failure: the node may serve
            broken = isinstance(result, Broken)
            attempt, next_admission, decode = self._take_over(result, exchange, continuations if broken else retries,
                                                              admission)
            if next_admission is not None:
                attempt.next_attempt = f"{exchange.request_id}.{attempt_no + 1}"
            self._finish(attempt_id, admission, attempt)
            if next_admission is None:
                return await self._give_up(result, admission, exchange, self._why_not(broken, continuations))
            if broken:
                continuations += 1
                self.metrics.continuations.labels(pool=exchange.pool).inc()
            else:
                retries += 1
                self.metrics.retries.labels(pool=exchange.pool).inc()
            admission, attempt_no = next_admission, attempt_no + 1

    def _decode_only(self, admission: Admission) -> bool:
        """A vllm pair's request short enough for its decode node to prefill alone (``decode_only_tokens``)."""
        return (admission.protocol == PdProtocol.VLLM and self.decode_only_tokens > 0 and admission.size is not None
                and admission.size.prompt_tokens <= self.decode_only_tokens)

    def _why_not(self, broken: bool, continuations: int) -> str:
        if not broken:
            return "the continuation failed and no retry was left"
        if continuations >= self.continue_limit:
            return f"--continue-limit {self.continue_limit} reached"
        return "no untried node to continue on"

    def _take_over(self, result: Failed | Broken, exchange: Exchange, used: int,
                   failed: Admission) -> tuple[Attempt, Admission | None, Admission | None]:
        """The failed attempt's record and the node that takes over, if the budget (``used`` of it)
        allows; in a P/D pool, a new pair (its prefill and decode admissions) for a broken stream or a
        failed ``sglang`` decode leg, another decode node with the same KV params for a ``vllm`` one."""
        if isinstance(result, Broken):
            next_admission = self._admit_next(exchange) if used < self.continue_limit else None
            next_admission, decode = self._with_decode(next_admission, exchange)
            if next_admission is not None:
                result.attempt.outcome = RequestOutcome.CONTINUED
            return result.attempt, next_admission, decode
        retry = result.retryable and used < self.max_retries
        role = NodeRole.DECODE if failed.role == NodeRole.DECODE and failed.protocol == PdProtocol.VLLM else None
        next_admission = self._admit_next(exchange, role) if retry else None
        next_admission, decode = self._with_decode(next_admission, exchange)
        return Attempt(outcome=RequestOutcome.UPSTREAM_ERROR, status=result.status,
                       duration_ms=_ms(time.perf_counter() - exchange.arrived),
                       error=(RETRIED_PREFIX if next_admission is not None else "") + result.reason), next_admission, decode

    def _admit_next(self, exchange: Exchange, role: NodeRole | None = None) -> Admission | None:
        """The node that takes over; a new sglang pair avoids the prefill nodes whose pair's decode
        leg failed beside them while another prefill node can serve (the decode's failure may have
        been its bootstrap with a prefill engine that died), else takes them again."""
        if exchange.suspect and role is None:
            admission = self.router.admit(exchange.pool, [*exchange.avoid(), *exchange.suspect])
            if admission is not None:
                return admission
        return self.router.admit(exchange.pool, exchange.avoid(), role=role)

    def _with_decode(self, admission: Admission | None,
                     exchange: Exchange) -> tuple[Admission | None, Admission | None]:
        """A new pair's decode node beside its prefill ``admission`` (neither when there is none)."""
        if admission is None or admission.role != NodeRole.PREFILL:
            return admission, None
        decode = self.router.admit(exchange.pool, exchange.avoid(), role=NodeRole.DECODE)
        if decode is None:
            self.router.release(admission)
            return None, None
        return admission, decode

    async def _give_up(self, result: Failed | Broken, admission: Admission, exchange: Exchange,
                       why: str) -> web.StreamResponse:
        """No attempt is left: answer the last failure, or end the client's stream with an error event."""
        client = exchange.client
        if client is None:
            assert isinstance(result, Failed)
            return self._tag(result.to_response(admission.node), admission, exchange)
        reason = result.reason if isinstance(result, Failed) else result.attempt.error
        with contextlib.suppress(ConnectionResetError, RuntimeError):  # the client may be gone too
            await client.response.write(sse_error(f"upstream node {admission.node} failed mid-stream: {reason} "
                                                  f"(not continued: {why})"))
            await client.response.write_eof()
        return client.response

    # -- a P/D pool's pairs (scheduler.routing.pd; docs/proxy.md) ---------------------------------

    async def _pair(self, exchange: Exchange, admission: Admission, decode: Admission | None, attempt_no: int,
                    retries: int) -> tuple[Admission, int, int] | web.StreamResponse:
        """A pair for the request (its first, or a new one after a failure or a break): the decode
        node (picked here for the first pair), then the protocol's prefill leg; the decode leg's
        admission, attempt number and the retries used, or the answer when no pair can serve."""
        if decode is None:
            decode = self.router.admit(exchange.pool, exchange.avoid(), role=NodeRole.DECODE)
        if decode is None:
            self.router.release(admission)
            message = f"no routable decode node in pool {exchange.pool} for the prefill/decode pair"
            self.events.refused(exchange.request_id, 503, RefusalCause.NO_ROUTABLE_NODE, message, pool=exchange.pool,
                                key_name=exchange.key_name)
            return error_response(503, message, "service_unavailable", RefusalCause.NO_ROUTABLE_NODE.value,
                                  headers={REQUEST_ID_HEADER: exchange.request_id})
        exchange.headers.setdefault("X-Request-Id", exchange.request_id)  # one id for both legs (vLLM's KV lookup)
        exchange.decoding = False
        base = exchange.body if exchange.continuation is None else exchange.continuation
        if admission.protocol == PdProtocol.SGLANG:
            return self._sglang_pair(exchange, admission, decode, attempt_no, retries, base)
        return await self._vllm_pair(exchange, admission, decode, attempt_no, retries, base)

    async def _vllm_pair(self, exchange: Exchange, admission: Admission, decode: Admission, attempt_no: int,
                         retries: int, base: bytes) -> tuple[Admission, int, int] | web.StreamResponse:
        """Run the prefill leg (retried on another prefill node while it fails, up to ``max_retries``);
        the decode body is ``exchange.leg_body``."""
        body = pd.prefill_body(base)  # the proxy admitted a JSON object (app.py)
        while True:
            attempt_id = exchange.request_id if attempt_no == 0 else f"{exchange.request_id}.{attempt_no}"
            self.events.started(attempt_id, admission.node, admission.pool, admission.snapshot_seq, admission.size,
                                exchange.key_name, admission.role)
            state = AttemptState(started=time.perf_counter())
            try:
                result = await self._prefill_leg(exchange, admission, state, body)
            except asyncio.CancelledError:
                outcome = RequestOutcome.ROUTER_ABORTED if self.aborting() else RequestOutcome.CLIENT_CANCELLED
                self._finish(attempt_id, admission, self._record(exchange, state, outcome, state.status, error="cancelled"))
                self.router.release(decode)
                raise
            finally:
                self.router.release(admission)
            duration = _ms(time.perf_counter() - exchange.arrived)
            if not isinstance(result, Failed):
                try:
                    params = pd.kv_transfer_params(result[0])
                except pd.PdBodyError as exc:  # a prefill engine without its KV connector: another may have one
                    result = Failed(reason=str(exc), status=state.status)
            if not isinstance(result, Failed):
                self.router.prefill_done(admission, time.perf_counter() - state.started)
                usage = result[1]
                self._finish(attempt_id, admission, Attempt(outcome=RequestOutcome.COMPLETED, status=state.status,
                                                            duration_ms=duration, prompt_tokens=usage[0],
                                                            completion_tokens=usage[1]))
                exchange.leg_body = pd.decode_body(base, params)
                return decode, attempt_no + 1, retries
            exchange.tried.append(admission.node)
            retry = result.retryable and retries < self.max_retries
            next_admission = self.router.admit(exchange.pool, exchange.avoid()) if retry else None
            attempt = Attempt(outcome=_leg_outcome(result), status=result.status, duration_ms=duration,
                              error=(RETRIED_PREFIX if next_admission is not None else "") + result.reason)
            if next_admission is not None:
                attempt.next_attempt = f"{exchange.request_id}.{attempt_no + 1}"
            self._finish(attempt_id, admission, attempt)
            if next_admission is None:
                self.router.release(decode)
                return await self._give_up(result, admission, exchange, "no prefill node left for a new pair")
            retries += 1
            self.metrics.retries.labels(pool=exchange.pool).inc()
            admission, attempt_no = next_admission, attempt_no + 1

    def _sglang_pair(self, exchange: Exchange, admission: Admission, decode: Admission, attempt_no: int,
                     retries: int, base: bytes) -> tuple[Admission, int, int]:
        """Start the prefill leg with a fresh bootstrap room; the decode leg (the same body) runs beside it."""
        room = secrets.randbits(pd.BOOTSTRAP_ROOM_BITS)
        exchange.leg_body = body = pd.sglang_body(base, pd.bootstrap_host(admission.url), admission.bootstrap_port,
                                                  room)
        attempt_id = exchange.request_id if attempt_no == 0 else f"{exchange.request_id}.{attempt_no}"
        self.events.started(attempt_id, admission.node, admission.pool, admission.snapshot_seq, admission.size,
                            exchange.key_name, admission.role)
        leg = PairLeg(admission, attempt_id, AttemptState(started=time.perf_counter()))
        leg.task = asyncio.create_task(self._sglang_prefill(exchange, leg, body))
        exchange.pair = leg
        return decode, attempt_no + 1, retries

    async def _sglang_prefill(self, exchange: Exchange, leg: PairLeg, body: bytes) -> Failed | None:
        """An sglang pair's prefill leg, recorded; its failure (None: completed)."""
        admission, state = leg.admission, leg.state
        try:
            result = await self._prefill_leg(exchange, admission, state, body)
        except asyncio.CancelledError:
            if leg.cancel_reason is None:  # the client went, or the proxy stops
                outcome = RequestOutcome.ROUTER_ABORTED if self.aborting() else RequestOutcome.CLIENT_CANCELLED
                self._finish(leg.attempt_id, admission, self._record(exchange, state, outcome, state.status,
                                                                     error="cancelled"))
                raise
            failed = Failed(reason=f"cancelled: {leg.cancel_reason}", status=state.status)
            self._finish(leg.attempt_id, admission, self._record(exchange, state, RequestOutcome.UPSTREAM_ERROR,
                                                                 state.status, error=failed.reason))
            return failed
        finally:
            self.router.release(admission)
        if isinstance(result, Failed):
            exchange.tried.append(admission.node)
            self._finish(leg.attempt_id, admission, Attempt(outcome=_leg_outcome(result), status=result.status,
                                                            duration_ms=_ms(time.perf_counter() - exchange.arrived),
                                                            error=result.reason))
            return result
        self.router.prefill_done(admission, time.perf_counter() - state.started)
        usage = result[1]
        self._finish(leg.attempt_id, admission, Attempt(outcome=RequestOutcome.COMPLETED, status=state.status,
                                                        duration_ms=_ms(time.perf_counter() - exchange.arrived),
                                                        prompt_tokens=usage[0], completion_tokens=usage[1]))
        return None

    async def _paired_attempt(self, request: web.BaseRequest, exchange: Exchange, admission: Admission,
                              attempt_id: str) -> Done | Failed | Broken:
        """An sglang pair's decode leg beside its prefill leg: when either fails first, the other is
        cancelled at once (a decode leg whose first byte came keeps its KV: a later prefill failure
        no longer matters); a completed decode leg gives its prefill leg ``PREFILL_GRACE_S`` to answer."""
        leg = exchange.pair
        assert leg is not None and leg.task is not None
        prefill = leg.task
        decode = asyncio.create_task(self._attempt_with_events(request, exchange, admission, attempt_id))
        try:
            await asyncio.wait((decode, prefill), return_when=asyncio.FIRST_COMPLETED)
            if prefill.done() and not decode.done():
                failure = prefill.result()
                if failure is not None and not exchange.decoding:
                    exchange.partner_failed = failure
                    decode.cancel()
            result = await decode
            failure = prefill.result() if prefill.done() else None
            if isinstance(result, Failed) and failure is not None and not result.partner and not exchange.decoding:
                # both ended in the same turn: the decode leg's failure is its prefill's (its bootstrap broke)
                result = Failed(reason=f"{result.reason} beside its failed prefill leg ({failure.reason})",
                                status=result.status, response=None if failure.retryable else failure.response,
                                retryable=failure.retryable, partner=True)
            if not prefill.done():
                if isinstance(result, Done):
                    await asyncio.wait((prefill,), timeout=PREFILL_GRACE_S)
                    why = f"its decode leg on {admission.node} ended {PREFILL_GRACE_S:g} s before it"
                else:
                    why = f"its decode leg on {admission.node} failed: " + (
                        result.reason if isinstance(result, Failed) else result.attempt.error or "broken")
                    if isinstance(result, Failed):
                        exchange.suspect.append(leg.admission.node)
                if not prefill.done():
                    leg.cancel_reason = why
                    prefill.cancel()
            await asyncio.wait((prefill,))
            return result
        except asyncio.CancelledError:  # the client went, or the proxy stops: both legs end with it
            decode.cancel()
            prefill.cancel()
            await asyncio.gather(decode, prefill, return_exceptions=True)
            raise
        finally:
            exchange.pair = None

    async def _prefill_leg(self, exchange: Exchange, admission: Admission, state: AttemptState,
                           body: bytes) -> tuple[bytes, tuple[int | None, int | None]] | Failed:
        """One prefill leg: its engine's 2xx answer (read whole) and its usage, or why it failed (an
        engine's 4xx is not retried: it is the client's request, answered as the engine said)."""
        if exchange.alias is not None:
            body = await self._as_node_model(body, exchange.alias, admission)
        state.sent = time.perf_counter()
        state.overhead = state.sent - exchange.arrived
        try:
            reply = await self.engines.request(exchange.method, admission.url, exchange.path_qs, exchange.headers, body)
        except (*TRANSPORT_ERRORS, ValueError) as exc:
            return Failed(reason=describe(exc))
        state.status = reply.status
        try:
            if reply.status >= 500:
                return await self._failed_status(reply, admission, exchange)
            try:
                answer = await reply.read()
            except TRANSPORT_ERRORS as exc:
                return Failed(reason=describe(exc), status=reply.status)
            if not 200 <= reply.status < 300:
                response = web.Response(status=reply.status, body=answer, headers=reply.headers)
                return Failed(reason=f"prefill leg answered HTTP {reply.status}", status=reply.status,
                              response=self._tag(response, admission, exchange), retryable=False)  # type: ignore[arg-type]
            return answer, usage_from_json(answer)
        finally:
            reply.close()

    async def _attempt_with_events(self, request: web.BaseRequest, exchange: Exchange, admission: Admission,
                                   attempt_id: str) -> Done | Failed | Broken:
        self.events.started(attempt_id, admission.node, admission.pool, admission.snapshot_seq, admission.size,
                            exchange.key_name, admission.role)
        state = AttemptState(started=time.perf_counter())
        result: Done | Failed | Broken
        try:
            result = await self._attempt(request, exchange, admission, state)
        except asyncio.CancelledError:
            partner = exchange.partner_failed
            if partner is None:
                aborted = self.aborting()
                outcome = RequestOutcome.ROUTER_ABORTED if aborted else RequestOutcome.CLIENT_CANCELLED
                self._finish(attempt_id, admission, self._record(exchange, state, outcome, state.status,
                                                                 error="cancelled"))
                if aborted and exchange.client is not None:
                    await _tell_aborted(exchange.client.response)
                raise
            exchange.partner_failed = None  # cancelled by _paired_attempt: its prefill leg failed
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            result = Failed(reason=f"cancelled: its prefill leg failed: {partner.reason}", status=state.status,
                            response=None if partner.retryable else partner.response, retryable=partner.retryable,
                            partner=True)
        finally:
            self.router.release(admission)
        if isinstance(result, Done):
            self._finish(attempt_id, admission, result.attempt)
            self._observe(exchange, state)
        return result

    def _finish(self, attempt_id: str, admission: Admission, attempt: Attempt) -> None:
        self.events.finished(attempt_id, admission.node, admission.pool, attempt, admission.role)
        self.metrics.count_request(admission.pool, admission.node, attempt.outcome, attempt.status)

    def _observe(self, exchange: Exchange, state: AttemptState) -> None:
        first_byte = exchange.client.first_byte if exchange.client is not None else state.first_byte
        sent = first_byte is not None
        if sent:  # bounds how long this proxy waits its turn before a pick (Router.stagger_s)
            self.router.first_byte(first_byte - exchange.arrived)  # type: ignore[operator]
        self.metrics.observe_latency(exchange.pool, first_byte - exchange.arrived if sent else None,  # type: ignore[operator]
                                     time.perf_counter() - exchange.arrived, state.overhead if sent else None)

    def _record(self, exchange: Exchange, state: AttemptState, outcome: str, status: int | None,
                usage: tuple[int | None, int | None] = (None, None), error: str | None = None) -> Attempt:
        now = time.perf_counter()
        if usage[0] is not None or usage[1] is not None:
            exchange.used_tokens = (usage[0] or 0) + (usage[1] or 0)
        ttft = None if state.first_byte is None else _ms(state.first_byte - exchange.arrived)
        return Attempt(outcome=outcome, status=status, ttft_ms=ttft, duration_ms=_ms(now - exchange.arrived),
                       prompt_tokens=usage[0], completion_tokens=usage[1], error=error)

    @staticmethod
    def _tag(response: web.StreamResponse, admission: Admission, exchange: Exchange) -> web.StreamResponse:
        """The engine's headers (copied into ``response``) minus what the proxy re-frames, plus ours."""
        strip(response.headers, RESPONSE_DROP)
        response.headers[NODE_HEADER] = admission.node
        response.headers[REQUEST_ID_HEADER] = exchange.request_id
        return response

    # -- one attempt ----------------------------------------------------------------------------

    async def _attempt(self, request: web.BaseRequest, exchange: Exchange, admission: Admission,
                       state: AttemptState) -> Done | Failed | Broken:
        body = exchange.leg_body if exchange.leg_body is not None else (
            exchange.body if exchange.continuation is None else exchange.continuation)
        if exchange.alias is not None:  # a pool's name: this node's own model id (never another node's)
            body = await self._as_node_model(body, exchange.alias, admission)
        state.sent = time.perf_counter()
        state.overhead = state.sent - exchange.arrived
        try:
            engine_response = await self.engines.request(exchange.method, admission.url, exchange.path_qs,
                                                         exchange.headers, body)
        except (*TRANSPORT_ERRORS, ValueError) as exc:  # ValueError: a bad URL
            return Failed(reason=describe(exc))
        state.status = engine_response.status  # recorded on every attempt the engine answered, cancelled ones too
        try:
            if engine_response.status >= 500:
                return await self._failed_status(engine_response, admission, exchange)
            if engine_response.content_type == "text/event-stream":
                return await self._stream(request, exchange, admission, state, engine_response)
            if exchange.client is not None:  # a continuation refused (e.g. an engine without the options)
                return Failed(reason=f"continuation answered HTTP {engine_response.status} "
                                     f"({engine_response.content_type})", status=engine_response.status,
                              retryable=False)
            return await self._buffered(request, exchange, admission, state, engine_response)
        finally:
            engine_response.close()  # no-op after a full read; on cancel or error it aborts the engine's work

    async def _as_node_model(self, body: bytes, alias: str, admission: Admission) -> bytes:
        ids = admission.models
        if ids is None and self.catalog is not None:  # not listed by the collector: the proxy's own cache
            ids = await self.catalog.node_models(admission.url)
        model = node_model(ids, alias)
        return body if model is None else with_model(body, model)

    async def _failed_status(self, engine_response: EngineReply, admission: Admission,
                             exchange: Exchange) -> Failed:
        try:
            body = await engine_response.read()
        except TRANSPORT_ERRORS:
            body = b""
        response = web.Response(status=engine_response.status, body=body, headers=engine_response.headers)
        self._tag(response, admission, exchange)
        return Failed(reason=f"HTTP {engine_response.status}", status=engine_response.status, response=response)

    async def _buffered(self, request: web.BaseRequest, exchange: Exchange, admission: Admission, state: AttemptState,
                        engine_response: EngineReply) -> Done | Failed:
        try:
            body = await engine_response.read()
        except TRANSPORT_ERRORS as exc:
            return Failed(reason=describe(exc), status=engine_response.status)
        received = time.perf_counter()
        response = web.Response(status=engine_response.status, body=body, headers=engine_response.headers)
        self._tag(response, admission, exchange)
        try:
            await response.prepare(request)
            state.first_byte = time.perf_counter()
            state.overhead += state.first_byte - received
            await response.write_eof()
        except (ConnectionResetError, RuntimeError) as exc:  # RuntimeError: transport already closed
            return Done(response, self._record(exchange, state, RequestOutcome.CLIENT_CANCELLED, engine_response.status,
                                               error=describe(exc)))
        usage = usage_from_json(body) if engine_response.content_type == "application/json" else (None, None)
        return Done(response, self._record(exchange, state, answered(engine_response.status), engine_response.status,
                                           usage))

    async def _stream(self, request: web.BaseRequest, exchange: Exchange, admission: Admission, state: AttemptState,
                      engine_response: EngineReply) -> Done | Failed | Broken:
        try:
            first = await engine_response.content.readany()
        except TRANSPORT_ERRORS as exc:
            return Failed(reason=describe(exc), status=engine_response.status)
        self.router.prefilled(admission)  # the engine's first token: the prompt is no longer its backlog
        exchange.decoding = True
        received = time.perf_counter()
        status = engine_response.status
        try:
            client = exchange.client or await self._open(request, exchange, admission, engine_response, state)
            state.overhead += time.perf_counter() - received
            if client.text is None:
                error, tail = await self._pump(engine_response, client.response, first)
                usage = usage_from_sse(tail)
            else:
                error = await self._relay(engine_response, client, first, state)
                usage = (client.text.prompt_tokens, client.text.attempt_tokens)
            if error is not None and client.text is not None and client.text.blocked is None:
                return await self._broken(exchange, client, state, status, error)
            if error is not None:
                why = client.not_continuable or (client.text.blocked if client.text else None)
                await client.response.write(sse_error(f"upstream node {admission.node} failed mid-stream: {error}"
                                                      + (f" (not continued: {why})" if why else "")))
            await client.response.write_eof()
        except (ConnectionResetError, RuntimeError) as exc:
            return Done(exchange.client.response if exchange.client else web.StreamResponse(),
                        self._record(exchange, state, RequestOutcome.CLIENT_CANCELLED, status, error=describe(exc)))
        if error is not None:
            return Done(client.response, self._record(exchange, state, RequestOutcome.UPSTREAM_ERROR, status, error=error))
        return Done(client.response, self._record(exchange, state, answered(status), status, usage or (None, None)))

    async def _open(self, request: web.BaseRequest, exchange: Exchange, admission: Admission,
                    engine_response: EngineReply, state: AttemptState) -> ClientStream:
        """Send the client the response headers: the first attempt to answer SSE opens its stream."""
        response = web.StreamResponse(status=engine_response.status, headers=engine_response.headers)
        self._tag(response, admission, exchange)
        kind = route_kind(exchange.path_qs)
        why = "--continue-limit is 0" if self.continue_limit == 0 else not_continuable(kind, exchange.body)
        text = StreamText(kind) if why is None and kind is not None else None
        await response.prepare(request)
        state.first_byte = time.perf_counter()
        exchange.client = ClientStream(response, state.first_byte, text, why)
        return exchange.client

    async def _broken(self, exchange: Exchange, client: ClientStream, state: AttemptState, status: int,
                      error: str) -> Done | Broken:
        """A continuable stream broke: end it here when nothing is left to generate, else continue it."""
        text = client.text
        assert text is not None
        usage = (text.prompt_tokens, text.attempt_tokens)
        body = continuation_body(exchange.body, text)
        if body is None:
            await client.response.write(text.ending())
            await client.response.write_eof()
            return Done(client.response, self._record(exchange, state, RequestOutcome.COMPLETED, status, usage,
                                                      error=f"{error} after the last token; the proxy ended the stream"))
        exchange.continuation = body
        text.next_attempt()
        return Broken(self._record(exchange, state, RequestOutcome.UPSTREAM_ERROR, status, usage, error=error))

    async def _relay(self, engine_response: EngineReply, client: ClientStream, first: bytes,
                     state: AttemptState) -> str | None:
        """Forward whole events as they complete, reading each; the break, if the stream broke."""
        text, response, content = client.text, client.response, engine_response.content
        assert text is not None
        framer, chunk = SseFramer(), first
        while True:
            outs: list[bytes] = []  # the whole events of this chunk, written together (one write, not one each)
            broke = None
            try:
                for event in framer.feed(chunk):
                    out = text.event(event)
                    if out is not None:
                        outs.append(out)
            except EngineBroke as exc:
                broke = str(exc)
            if outs:
                await response.write(outs[0] if len(outs) == 1 else b"".join(outs))  # ConnectionResetError: client gone
                if state.first_byte is None:
                    state.first_byte = time.perf_counter()
            if broke is not None:
                return broke
            if not chunk:
                return None if text.done or text.finished else "the stream ended before its finish"
            try:
                chunk = content.read_nowait()  # what has come meanwhile: no stall timer to set
                if not chunk and not content.at_eof():
                    async with asyncio.timeout(self.stall_timeout_s):
                        chunk = await content.readany()
            except asyncio.TimeoutError:
                return None if text.done else f"stalled: no byte for {self.stall_timeout_s:g} s"
            except TRANSPORT_ERRORS as exc:
                return None if text.done else describe(exc)

    @staticmethod
    async def _pump(engine_response: EngineReply, response: web.StreamResponse,
                    first: bytes) -> tuple[str | None, bytes]:
        """Copy the stream as it arrives: the upstream error that cut it, if any, and its last chunks (``usage``)."""
        tail: deque[bytes] = deque(maxlen=_TAIL_CHUNKS)
        chunk, content = first, engine_response.content
        while chunk:
            await response.write(chunk)  # ConnectionResetError here means the client went away
            tail.append(chunk)
            try:
                chunk = await content.readany()
            except TRANSPORT_ERRORS as exc:
                return describe(exc), b""
        return None, b"".join(tail)


async def _tell_aborted(response: web.StreamResponse) -> None:
    """Best effort: end an SSE stream cut by shutdown with an error event, not silently."""
    try:
        await asyncio.wait_for(response.write(sse_error("proxy shut down before the stream ended")), 0.5)
        await asyncio.wait_for(response.write_eof(), 0.5)
    except (asyncio.TimeoutError, ConnectionResetError, RuntimeError):
        pass


def _leg_outcome(result: Failed) -> RequestOutcome:
    """A failed prefill leg's outcome: the engine's 4xx answer is ``engine_error``, anything else ``upstream_error``."""
    answered_4xx = not result.retryable and result.status is not None and result.status < 500
    return RequestOutcome.ENGINE_ERROR if answered_4xx else RequestOutcome.UPSTREAM_ERROR


def answered(status: int) -> RequestOutcome:
    """The outcome of an engine's answer (below 500) that reached the client whole: ``completed``
    for a 2xx, ``engine_error`` for anything else (a 4xx, a 3xx): docs/wire.md, "Engine errors and the
    router's own answers"."""
    return RequestOutcome.COMPLETED if 200 <= status < 300 else RequestOutcome.ENGINE_ERROR


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def forward_headers(headers: Mapping[str, str], request_id: str) -> CIMultiDict[str]:
    """The client's headers for the engine, minus hop-by-hop ones and what the transport sets.
    A client that named no ``Accept-Encoding`` gets ``identity``: without the header an engine
    may pick any coding (RFC 9110 §12.5.3), but the proxy passes bodies through undecoded to a
    client that never said it can decode them, and reads ``usage`` from JSON and SSE events."""
    out: CIMultiDict[str] = CIMultiDict(headers)
    strip(out, REQUEST_DROP)
    out.setdefault("Accept-Encoding", "identity")
    out[REQUEST_ID_HEADER] = request_id
    return out


def strip(headers: CIMultiDict[str], names: tuple[str, ...]) -> None:
    """Remove every header named in ``names`` (C-level copies and pops: cheaper than a filtering loop)."""
    for name in names:
        headers.popall(name, None)


def describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return f"timeout ({type(exc).__name__})"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]


def sse_error(message: str) -> bytes:
    return b"data: " + json.dumps(error_body(message, SSE_ERROR_TYPE, 502)).encode() + b"\n\n"


class _UsagePeek(msgspec.Struct):
    """Only ``usage`` of an answer or SSE event is built into Python objects; the rest is skipped."""

    usage: Any = None


_USAGE = msgspec.json.Decoder(_UsagePeek)


def _usage_of(payload: bytes) -> tuple[int | None, int | None] | None:
    """Token counts of one JSON object; None when it is not an object or carries no ``usage`` object."""
    try:
        usage = _USAGE.decode(payload).usage
    except msgspec.DecodeError:  # its subclass ValidationError too: not a JSON object
        return None
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (prompt if isinstance(prompt, int) and prompt >= 0 else None,
            completion if isinstance(completion, int) and completion >= 0 else None)


def usage_from_json(body: bytes) -> tuple[int | None, int | None]:
    return _usage_of(body) or (None, None)


def usage_from_sse(tail: bytes) -> tuple[int | None, int | None]:
    """Token counts from the last SSE data events (vLLM's ``stream_options.include_usage`` chunk)."""
    seen = 0
    for event in reversed(tail.split(b"\n\n")):
        line = event.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if not payload.startswith(b"{"):
            continue
        seen += 1
        found = _usage_of(payload)
        if found is not None or seen >= 3:
            return found or (None, None)
    return None, None
