"""One attempt on one engine: send the request, then pass the answer to the client (whole, or
streamed: SSE event by event when it may be continued, chunk by chunk otherwise), and say how it
ended (``exchange.Done``, ``Failed`` or ``Broken``); the drivers in services/proxy/upstream.py and
services/proxy/pairs.py decide what follows (``scheduler.routing.attempts``). The rules it keeps
are in services/proxy/upstream.py's header."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from aiohttp import web

from laswrr.schemas.words import FailureKind, RequestOutcome
from laswrr.scheduler.routing.continuation import (
    Broken as EngineBroke,
    SseFramer,
    StreamText,
    continuation_body,
    not_continuable,
    route_kind,
)
from laswrr.scheduler.routing.models import node_model
from laswrr.scheduler.routing.router import Admission, Router
from laswrr.services.proxy.answers import (
    answered,
    describe,
    failure_kind,
    sse_error,
    tag,
    tell_aborted,
    usage_from_json,
    usage_from_sse,
    with_model,
)
from laswrr.services.proxy.engine_errors import as_openai_error
from laswrr.services.proxy.events import Attempt, EventPublisher
from laswrr.services.proxy.exchange import AttemptState, Broken, ClientStream, Done, Exchange, Failed, Result, ms
from laswrr.services.proxy.metrics import ProxyMetrics
from laswrr.services.proxy.transport import TRANSPORT_ERRORS, EngineReply, EngineTransport

_TAIL_CHUNKS = 4
Usage = tuple[int | None, int | None]


class NodeModels(Protocol):
    """Where the forwarder finds a node's model ids the snapshot does not list (``models.ModelCatalog``)."""

    async def node_models(self, url: str) -> list[str]: ...


class AttemptRunner:
    """Runs attempts and records them: one started/finished pair per attempt (services/proxy/events.py)."""

    def __init__(self, engines: EngineTransport, router: Router, events: EventPublisher, metrics: ProxyMetrics,
                 aborting: Callable[[], bool], continue_limit: int, stall_timeout_s: float,
                 catalog: NodeModels | None) -> None:
        self.engines = engines  # the engine transport (services/proxy/transport.py)
        self.router, self.events, self.metrics, self.aborting = router, events, metrics, aborting
        self.continue_limit, self.stall_timeout_s = continue_limit, stall_timeout_s
        self.catalog = catalog  # model ids of nodes the snapshot has no list for

    # -- events ------------------------------------------------------------------------------------

    def started(self, attempt_id: str, admission: Admission, exchange: Exchange) -> AttemptState:
        self.events.started(attempt_id, admission.node, admission.pool, admission.snapshot_seq, admission.size,
                            exchange.key_name, admission.role, exchange.objective, admission.cached,
                            admission.estimate, admission.predicted)
        return AttemptState(started=time.perf_counter())

    def finish(self, attempt_id: str, admission: Admission, exchange: Exchange, attempt: Attempt) -> None:
        """Record the attempt (its ``stream``: the client's answer is an SSE stream by now); a
        completed streamed one then teaches its node's latency estimate from the figures just
        recorded (``Admitter.observed``), so a refold of the log learns the same, in the same
        order: its own times, from its start (time held in flow control or spent on an earlier
        attempt is not the node's). A whole answer teaches nothing: its first byte came with its
        last token, so it splits into no prefill and decode time."""
        attempt.stream = exchange.client is not None
        self.events.finished(attempt_id, admission.node, admission.pool, attempt, admission.role)
        self.metrics.count_request(admission.pool, admission.node, attempt.outcome, attempt.status)
        if attempt.stream and attempt.outcome is RequestOutcome.COMPLETED:
            self.router.admitter.observed(admission, attempt.ttft_ms, attempt.started_ms, attempt.duration_ms,
                                          attempt.completion_tokens)

    def cancelled(self, attempt_id: str, admission: Admission, exchange: Exchange, state: AttemptState) -> bool:
        """Record an attempt the client's leaving (or the proxy's stop) cancelled; True when the proxy stops."""
        aborted = self.aborting()
        outcome = RequestOutcome.ROUTER_ABORTED if aborted else RequestOutcome.CLIENT_CANCELLED
        self.finish(attempt_id, admission, exchange, record(exchange, state, outcome, state.status, error="cancelled"))
        return aborted

    def _observe(self, exchange: Exchange, state: AttemptState) -> None:
        """The request's latencies: its first byte bounds the pick's stagger, a stream's is its TTFT
        (a whole answer's first byte is its end: no time to first token)."""
        first_byte = exchange.client.first_byte if exchange.client is not None else state.first_byte
        sent = first_byte is not None
        if sent:  # bounds how long this proxy waits its turn before a pick (Router.stagger_s)
            self.router.first_byte(first_byte - exchange.arrived)  # type: ignore[operator]
        ttft = None if exchange.client is None else exchange.client.first_byte - exchange.arrived
        self.metrics.observe_latency(exchange.pool, ttft, time.perf_counter() - exchange.arrived,
                                     state.overhead if sent else None)

    # -- an attempt whose answer is the client's (a whole request, a decode leg) ---------------------

    async def run(self, request: web.BaseRequest, exchange: Exchange, admission: Admission, attempt_id: str,
                  body: bytes, state: AttemptState) -> Result:
        """One attempt, its node released when it ends; a Done one is recorded here, the others by the driver."""
        try:
            result = await self._attempt(request, exchange, admission, state, body)
        except asyncio.CancelledError:
            partner = state.partner_failed
            if partner is None:
                if self.cancelled(attempt_id, admission, exchange, state) and exchange.client is not None:
                    await tell_aborted(exchange.client.response)
                raise
            task = asyncio.current_task()  # cancelled by its sglang pair: its prefill leg failed
            if task is not None:
                task.uncancel()
            result = Failed(FailureKind.PARTNER_FAILED, f"cancelled: its prefill leg failed: {partner.reason}",
                            status=state.status, response=None if partner.retryable else partner.response,
                            retryable=partner.retryable, partner=True)
        finally:
            self.router.admitter.release(admission)
        if isinstance(result, Done):
            self.finish(attempt_id, admission, exchange, result.attempt)
            self._observe(exchange, state)
        return result

    async def _send(self, exchange: Exchange, admission: Admission, state: AttemptState,
                    body: bytes) -> EngineReply | Failed:
        if exchange.alias is not None:  # a pool's name: this node's own model id (never another node's)
            ids = admission.models
            if ids is None and self.catalog is not None:  # not listed by the collector: the proxy's own cache
                ids = await self.catalog.node_models(admission.url)
            model = node_model(ids, exchange.alias)
            body = body if model is None else with_model(body, model)
        state.sent = time.perf_counter()
        state.overhead = state.sent - exchange.arrived
        try:
            reply = await self.engines.request(exchange.method, admission.url, exchange.path_qs, exchange.headers, body)
        except (*TRANSPORT_ERRORS, ValueError) as exc:  # ValueError: a bad URL
            return Failed(failure_kind(exc), describe(exc))
        state.status = reply.status  # recorded on every attempt the engine answered, cancelled ones too
        if reply.status < 500:
            return reply
        try:
            return await self._failed_status(reply, admission, exchange)
        finally:
            reply.close()

    async def _attempt(self, request: web.BaseRequest, exchange: Exchange, admission: Admission,
                       state: AttemptState, body: bytes) -> Result:
        engine_response = await self._send(exchange, admission, state, body)
        if isinstance(engine_response, Failed):
            return engine_response
        try:
            if engine_response.content_type == "text/event-stream":
                return await self._stream(request, exchange, admission, state, engine_response)
            if exchange.client is not None:  # a continuation refused (e.g. an engine without the options)
                return Failed(FailureKind.NOT_SSE, f"continuation answered HTTP {engine_response.status} "
                                                   f"({engine_response.content_type})", status=engine_response.status,
                              retryable=False)
            return await self._buffered(request, exchange, admission, state, engine_response)
        finally:
            engine_response.close()  # no-op after a full read; on cancel or error it aborts the engine's work

    async def _failed_status(self, engine_response: EngineReply, admission: Admission,
                             exchange: Exchange) -> Failed:
        try:
            body = await engine_response.read()
        except TRANSPORT_ERRORS:
            body = b""
        body, headers = as_openai_error(engine_response.status, engine_response.content_type, body,
                                        engine_response.headers)
        response = web.Response(status=engine_response.status, body=body, headers=headers)
        tag(response, admission.node, exchange.request_id)
        return Failed(FailureKind.ENGINE_5XX, f"HTTP {engine_response.status}", status=engine_response.status,
                      response=response)

    async def _buffered(self, request: web.BaseRequest, exchange: Exchange, admission: Admission, state: AttemptState,
                        engine_response: EngineReply) -> Done | Failed:
        try:
            body = await engine_response.read()
        except TRANSPORT_ERRORS as exc:
            return Failed(failure_kind(exc), describe(exc), status=engine_response.status)
        received = time.perf_counter()
        body, headers = as_openai_error(engine_response.status, engine_response.content_type, body,
                                        engine_response.headers)
        response = web.Response(status=engine_response.status, body=body, headers=headers)
        tag(response, admission.node, exchange.request_id)
        try:
            await response.prepare(request)
            state.first_byte = time.perf_counter()
            state.overhead += state.first_byte - received
            await response.write_eof()
        except (ConnectionResetError, RuntimeError) as exc:  # RuntimeError: transport already closed
            return Done(response, record(exchange, state, RequestOutcome.CLIENT_CANCELLED, engine_response.status,
                                         error=describe(exc)))
        usage = usage_from_json(body) if engine_response.content_type == "application/json" else (None, None)
        return Done(response, record(exchange, state, answered(engine_response.status), engine_response.status, usage))

    async def _stream(self, request: web.BaseRequest, exchange: Exchange, admission: Admission, state: AttemptState,
                      engine_response: EngineReply) -> Result:
        try:
            first = await engine_response.content.readany()
        except TRANSPORT_ERRORS as exc:
            return Failed(failure_kind(exc), describe(exc), status=engine_response.status)
        self.router.admitter.prefilled(admission)  # the engine's first token: the prompt is no longer its backlog
        state.streaming = True
        received = time.perf_counter()
        status = engine_response.status
        try:
            client = exchange.client or await self._open(request, exchange, admission, engine_response, state)
            state.overhead += time.perf_counter() - received
            if client.text is None:
                error, tail = await _pump(engine_response, client.response, first)
                usage = usage_from_sse(tail)
            else:
                error = await _relay(engine_response, client, first, state, self.stall_timeout_s)
                usage = (client.text.prompt_tokens, client.text.attempt_tokens)
            if error is not None and client.text is not None and client.text.blocked is None:
                return await _broken(exchange, client, state, status, error)
            if error is not None:
                why = client.not_continuable or (client.text.blocked if client.text else None)
                await client.response.write(sse_error(f"upstream node {admission.node} failed mid-stream: {error}"
                                                      + (f" (not continued: {why})" if why else "")))
            await client.response.write_eof()
        except (ConnectionResetError, RuntimeError) as exc:
            return Done(exchange.client.response if exchange.client else web.StreamResponse(),
                        record(exchange, state, RequestOutcome.CLIENT_CANCELLED, status, error=describe(exc)))
        if error is not None:
            return Done(client.response, record(exchange, state, RequestOutcome.UPSTREAM_ERROR, status, error=error))
        return Done(client.response, record(exchange, state, answered(status), status, usage or (None, None)))

    async def _open(self, request: web.BaseRequest, exchange: Exchange, admission: Admission,
                    engine_response: EngineReply, state: AttemptState) -> ClientStream:
        """Send the client the response headers: the first attempt to answer SSE opens its stream."""
        response = web.StreamResponse(status=engine_response.status, headers=engine_response.headers)
        tag(response, admission.node, exchange.request_id)
        kind = route_kind(exchange.path_qs)
        why = "--continue-limit is 0" if self.continue_limit == 0 else not_continuable(kind, exchange.body)
        text = StreamText(kind) if why is None and kind is not None else None
        await response.prepare(request)
        state.first_byte = time.perf_counter()
        exchange.client = ClientStream(response, state.first_byte, text, why)
        return exchange.client

    # -- a prefill leg (its answer is the pair's, never the client's) --------------------------------

    async def prefill(self, exchange: Exchange, admission: Admission, state: AttemptState,
                      body: bytes) -> tuple[bytes, Usage] | Failed:
        """One prefill leg: its engine's 2xx answer (read whole) and its usage, or why it failed (an
        engine's 4xx is not retried: it is the client's request, answered as the engine said)."""
        reply = await self._send(exchange, admission, state, body)
        if isinstance(reply, Failed):
            return reply
        try:
            try:
                answer = await reply.read()
            except TRANSPORT_ERRORS as exc:
                return Failed(failure_kind(exc), describe(exc), status=reply.status)
            if not 200 <= reply.status < 300:
                response = web.Response(status=reply.status, body=answer, headers=reply.headers)
                tag(response, admission.node, exchange.request_id)
                return Failed(FailureKind.ENGINE_REFUSED, f"prefill leg answered HTTP {reply.status}",
                              status=reply.status, response=response, retryable=False)
            return answer, usage_from_json(answer)
        finally:
            reply.close()

    def prefilled(self, attempt_id: str, admission: Admission, exchange: Exchange, state: AttemptState,
                  usage: Usage) -> None:
        """Record a prefill leg that answered: its node's prefill rate, and its finished event."""
        self.router.admitter.prefill_done(admission, time.perf_counter() - state.started)
        self.finish(attempt_id, admission, exchange,
                    Attempt(outcome=RequestOutcome.COMPLETED, status=state.status,
                            duration_ms=ms(time.perf_counter() - exchange.arrived),
                            prompt_tokens=usage[0], completion_tokens=usage[1]))


def record(exchange: Exchange, state: AttemptState, outcome: RequestOutcome, status: int | None,
           usage: Usage = (None, None), error: str | None = None) -> Attempt:
    """The finished event of an attempt; its usage is the exchange's tokens so far (flow control's tpm)."""
    now = time.perf_counter()
    if usage[0] is not None or usage[1] is not None:
        exchange.used_tokens = (usage[0] or 0) + (usage[1] or 0)
    ttft = None if state.first_byte is None else ms(state.first_byte - exchange.arrived)
    return Attempt(outcome=outcome, status=status, ttft_ms=ttft, duration_ms=ms(now - exchange.arrived),
                   prompt_tokens=usage[0], completion_tokens=usage[1], error=error,
                   started_ms=ms(state.started - exchange.arrived))


async def _broken(exchange: Exchange, client: ClientStream, state: AttemptState, status: int, error: str) -> Done | Broken:
    """A continuable stream broke: end it here when nothing is left to generate, else continue it."""
    text = client.text
    assert text is not None
    usage = (text.prompt_tokens, text.attempt_tokens)
    body = continuation_body(exchange.body, text)
    if body is None:
        await client.response.write(text.ending())
        await client.response.write_eof()
        return Done(client.response, record(exchange, state, RequestOutcome.COMPLETED, status, usage,
                                            error=f"{error} after the last token; the proxy ended the stream"))
    exchange.continuation = body
    text.next_attempt()
    return Broken(record(exchange, state, RequestOutcome.UPSTREAM_ERROR, status, usage, error=error))


async def _pump(engine_response: EngineReply, response: web.StreamResponse, first: bytes) -> tuple[str | None, bytes]:
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


async def _relay(engine_response: EngineReply, client: ClientStream, first: bytes, state: AttemptState,
                 stall_timeout_s: float) -> str | None:
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
                async with asyncio.timeout(stall_timeout_s):
                    chunk = await content.readany()
        except asyncio.TimeoutError:
            return None if text.done else f"stalled: no byte for {stall_timeout_s:g} s"
        except TRANSPORT_ERRORS as exc:
            return None if text.done else describe(exc)
