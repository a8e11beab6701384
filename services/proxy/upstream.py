"""Forwarding one client request to an engine: admission, retries, streaming, outcomes.

Rules (issue 4, "never cut"):

* The upstream URL is bound when the request is admitted (``routing.Admission``); nothing that
  happens to snapshots afterwards reaches an admitted request.
* An attempt may be retried on another node (never one already tried) only while **no byte has
  reached the client**: on a connection failure, a timeout, a 5xx status, or a body that breaks
  before its first chunk. The client response is prepared only when the first body chunk is in
  hand, so "headers arrived, then the engine died" is still retryable. At most ``max_retries``
  retries; when none is left (or no untried node remains) the last failure is answered: the
  engine's own 5xx passes through, a connection failure becomes 502, a timeout 504.
* After the first byte a failure ends an SSE stream with ``data: {"error": {...}}`` and the
  outcome ``upstream_error``; the client gets what the engine produced up to the cut.
* SSE (``text/event-stream``) is written chunk by chunk as read (``iter_any``), each write
  awaited (backpressure); nothing else is buffered. Other answers (JSON) are read whole first,
  which keeps them retryable to the last byte and lets the proxy read ``usage``.
* Engine response headers pass through, minus hop-by-hop ones and the length (the proxy
  re-frames); ``x-laswrr-node`` names the node. Bodies pass byte for byte (no decompression).
  Redirects pass through to the client too (never followed), and the session keeps no cookies
  (``DummyCookieJar``): one client's ``Set-Cookie`` must never reach another client's request.
* Client gone (aiohttp cancels the handler, or a write fails) -> the upstream response is
  closed, which cancels the engine's work; outcome ``client_cancelled``. A cancel during
  shutdown after the grace period is ``router_aborted``.

Events: one started/finished pair per attempt (see ``services.proxy.events``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from multidict import CIMultiDict

from laswrr.services.proxy.events import RETRIED_PREFIX, Attempt, EventPublisher
from laswrr.services.proxy.metrics import ProxyMetrics
from laswrr.services.proxy.routing import Admission, Router

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


def error_body(message: str, err_type: str, code: str | int | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "code": code, "param": None}}


def error_response(status: int, message: str, err_type: str, code: str | int | None,
                   headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(message, err_type, code), status=status, headers=headers)


class ClientGone(Exception):
    """Writing to the client failed: it went away."""


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


@dataclass(slots=True)
class AttemptState:
    """What one attempt has done so far; read by the caller when the attempt is cancelled."""

    started: float
    sent: float | None = None  # upstream request issued
    first_byte: float | None = None  # first byte written to the client
    overhead: float = 0.0
    sse: web.StreamResponse | None = None  # the client's SSE response, once prepared


@dataclass(slots=True)
class Failed:
    """An attempt that failed before any byte reached the client (retryable)."""

    reason: str
    status: int | None = None
    response: web.Response | None = None  # the engine's 5xx, passed through if no retry is left

    def to_response(self, node: str) -> web.Response:
        if self.response is not None:
            return self.response
        if self.reason.startswith("timeout"):
            return error_response(504, f"upstream node {node} timed out: {self.reason}", SSE_ERROR_TYPE, "upstream_timeout")
        return error_response(502, f"upstream node {node} failed: {self.reason}", SSE_ERROR_TYPE, "upstream_unreachable")


@dataclass(slots=True)
class Done:
    response: web.StreamResponse
    attempt: Attempt


class Forwarder:
    def __init__(self, session: aiohttp.ClientSession, router: Router, events: EventPublisher,
                 metrics: ProxyMetrics, max_retries: int, timeout: aiohttp.ClientTimeout,
                 aborting: Callable[[], bool]) -> None:
        self.session = session
        self.router = router
        self.events = events
        self.metrics = metrics
        self.max_retries = max_retries
        self.timeout = timeout
        self.aborting = aborting

    async def forward(self, request: web.Request, ex: Exchange, admission: Admission) -> web.StreamResponse:
        """Run attempts until one answers or retries run out; ``admission`` is the first node."""
        attempt_no = 0
        while True:
            rid = ex.request_id if attempt_no == 0 else f"{ex.request_id}.{attempt_no}"
            ex.tried.append(admission.node)
            result = await self._attempt_with_events(request, ex, admission, rid)
            if isinstance(result, Done):
                return result.response
            nxt = self.router.admit(ex.pool, ex.tried) if attempt_no < self.max_retries else None
            prefix = RETRIED_PREFIX if nxt is not None else ""
            self._finish(rid, admission, Attempt(outcome="upstream_error", status=result.status,
                                                 duration_ms=_ms(time.perf_counter() - ex.arrived),
                                                 error=prefix + result.reason))
            if nxt is None:
                return self._tag(result.to_response(admission.node), admission, ex)
            self.metrics.retries.labels(pool=ex.pool).inc()
            admission, attempt_no = nxt, attempt_no + 1

    async def _attempt_with_events(self, request: web.Request, ex: Exchange, admission: Admission,
                                   rid: str) -> Done | Failed:
        self.events.started(rid, admission.node, admission.pool, admission.snapshot_seq)
        state = AttemptState(started=time.perf_counter())
        try:
            result = await self._attempt(request, ex, admission, state)
        except asyncio.CancelledError:
            aborted = self.aborting()
            outcome = "router_aborted" if aborted else "client_cancelled"
            self._finish(rid, admission, self._record(ex, state, outcome, None, error="cancelled"))
            if aborted and state.sse is not None:
                await _tell_aborted(state.sse)
            raise
        finally:
            self.router.release(admission)
        if isinstance(result, Done):
            self._finish(rid, admission, result.attempt)
            self._observe(ex, state)
        return result

    def _finish(self, rid: str, admission: Admission, attempt: Attempt) -> None:
        self.events.finished(rid, admission.node, admission.pool, attempt)
        self.metrics.count_request(admission.pool, admission.node, attempt.outcome)

    def _observe(self, ex: Exchange, state: AttemptState) -> None:
        sent = state.first_byte is not None
        self.metrics.observe_latency(ex.pool, state.first_byte - ex.arrived if sent else None,  # type: ignore[operator]
                                     time.perf_counter() - ex.arrived, state.overhead if sent else None)

    def _record(self, ex: Exchange, state: AttemptState, outcome: str, status: int | None,
                usage: tuple[int | None, int | None] = (None, None), error: str | None = None) -> Attempt:
        now = time.perf_counter()
        ttft = None if state.first_byte is None else _ms(state.first_byte - ex.arrived)
        return Attempt(outcome=outcome, status=status, ttft_ms=ttft, duration_ms=_ms(now - ex.arrived),
                       prompt_tokens=usage[0], completion_tokens=usage[1], error=error)

    @staticmethod
    def _tag(response: web.StreamResponse, admission: Admission, ex: Exchange) -> web.StreamResponse:
        """The engine's headers (copied into ``response``) minus what the proxy re-frames, plus ours."""
        strip(response.headers, RESPONSE_DROP)
        response.headers[NODE_HEADER] = admission.node
        response.headers[REQUEST_ID_HEADER] = ex.request_id
        return response

    # -- one attempt ----------------------------------------------------------------------------

    async def _attempt(self, request: web.Request, ex: Exchange, admission: Admission,
                       state: AttemptState) -> Done | Failed:
        url = upstream_url(admission.url, ex.path_qs)
        state.sent = time.perf_counter()
        state.overhead = state.sent - ex.arrived
        try:
            up = await self.session.request(ex.method, url, data=ex.body, headers=ex.headers, timeout=self.timeout,
                                            allow_redirects=False)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return Failed(reason=describe(exc))
        try:
            if up.status >= 500:
                return await self._failed_status(up, admission, ex)
            if up.content_type == "text/event-stream":
                return await self._stream(request, ex, admission, state, up)
            return await self._buffered(request, ex, admission, state, up)
        finally:
            up.close()  # no-op after a full read; on cancel or error it aborts the engine's work

    async def _failed_status(self, up: aiohttp.ClientResponse, admission: Admission, ex: Exchange) -> Failed:
        try:
            body = await up.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            body = b""
        response = web.Response(status=up.status, body=body, headers=up.headers)
        self._tag(response, admission, ex)
        return Failed(reason=f"HTTP {up.status}", status=up.status, response=response)

    async def _buffered(self, request: web.Request, ex: Exchange, admission: Admission, state: AttemptState,
                        up: aiohttp.ClientResponse) -> Done | Failed:
        try:
            body = await up.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return Failed(reason=describe(exc), status=up.status)
        received = time.perf_counter()
        response = web.Response(status=up.status, body=body, headers=up.headers)
        self._tag(response, admission, ex)
        try:
            await response.prepare(request)
            state.first_byte = time.perf_counter()
            state.overhead += state.first_byte - received
            await response.write_eof()
        except (ConnectionResetError, RuntimeError) as exc:  # RuntimeError: transport already closed
            return Done(response, self._record(ex, state, "client_cancelled", up.status, error=describe(exc)))
        usage = usage_from_json(body) if up.content_type == "application/json" else (None, None)
        return Done(response, self._record(ex, state, "completed", up.status, usage))

    async def _stream(self, request: web.Request, ex: Exchange, admission: Admission, state: AttemptState,
                      up: aiohttp.ClientResponse) -> Done | Failed:
        try:
            first = await up.content.readany()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return Failed(reason=describe(exc), status=up.status)
        received = time.perf_counter()
        response = web.StreamResponse(status=up.status, headers=up.headers)
        self._tag(response, admission, ex)
        tail: deque[bytes] = deque(maxlen=_TAIL_CHUNKS)
        try:
            await response.prepare(request)
            state.sse = response
            if first:
                await response.write(first)
                tail.append(first)
            state.first_byte = time.perf_counter()
            state.overhead += state.first_byte - received
            error = await self._pump(up, response, tail)
            if error is not None:
                await response.write(sse_error(f"upstream node {admission.node} failed mid-stream: {error}"))
            await response.write_eof()
        except (ConnectionResetError, RuntimeError) as exc:
            return Done(response, self._record(ex, state, "client_cancelled", up.status, error=describe(exc)))
        if error is not None:
            return Done(response, self._record(ex, state, "upstream_error", up.status, error=error))
        return Done(response, self._record(ex, state, "completed", up.status, usage_from_sse(b"".join(tail))))

    @staticmethod
    async def _pump(up: aiohttp.ClientResponse, response: web.StreamResponse, tail: deque[bytes]) -> str | None:
        """Copy the rest of the stream as it arrives; the upstream error that cut it, if any."""
        content = up.content
        while True:
            try:
                chunk = await content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                return describe(exc)
            if not chunk:
                return None
            await response.write(chunk)  # ConnectionResetError here means the client went away
            tail.append(chunk)


async def _tell_aborted(response: web.StreamResponse) -> None:
    """Best effort: end an SSE stream cut by shutdown with an error event, not silently."""
    try:
        await asyncio.wait_for(response.write(sse_error("proxy shut down before the stream ended")), 0.5)
        await asyncio.wait_for(response.write_eof(), 0.5)
    except (asyncio.TimeoutError, ConnectionResetError, RuntimeError):
        pass


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def upstream_url(base: str, path_qs: str) -> str:
    base = base.rstrip("/")
    if base.endswith("/v1") and path_qs.startswith("/v1/"):
        base = base[:-3]
    return base + path_qs


def forward_headers(headers: Mapping[str, str], request_id: str) -> CIMultiDict[str]:
    """The client's headers for the engine. A client that asked for no encoding gets none: ``identity``
    (else aiohttp would offer gzip for it, and the proxy passes bodies through undecoded)."""
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
