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
* Client gone (aiohttp cancels the handler, or a write fails) -> the upstream response is
  closed, which cancels the engine's work; outcome ``client_cancelled``. A cancel during
  shutdown after the grace period is ``router_aborted``.

Transport: ``http://`` engines are reached through ``upstream_http.UpstreamPool`` (keep-alive,
one write per request); any other scheme through the aiohttp session. Both answers are seen
through the same small interface (status, content_type, headers, read, readany, close).

Events: one started/finished pair per attempt (see ``services.proxy.events``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
import msgspec
from multidict import CIMultiDict

from services.proxy.events import RETRIED_PREFIX, Attempt, EventPublisher
from services.proxy.metrics import ProxyMetrics
from services.proxy.routing import Admission, Router
from services.proxy.server import Responder
from services.proxy.upstream_http import UpstreamError, UpstreamPool, request_head

NODE_HEADER = "x-laswrr-node"
REQUEST_ID_HEADER = "x-laswrr-request-id"
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})
REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "expect"}  # the body is already read
RESPONSE_DROP = HOP_BY_HOP | {"content-length"}
_REQUEST_DROP_BYTES = frozenset(name.encode() for name in REQUEST_DROP)
_RESPONSE_DROP_BYTES = frozenset(name.encode() for name in RESPONSE_DROP)
UPSTREAM_ERRORS = (UpstreamError, aiohttp.ClientError, asyncio.TimeoutError, OSError)
SSE_ERROR_TYPE = "upstream_error"
_TAIL_CHUNKS = 4


def error_body(message: str, err_type: str, code: str | int | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "code": code, "param": None}}


_JSON = msgspec.json.Encoder()
JSON_TYPE = ("Content-Type", "application/json; charset=utf-8")


@dataclass(slots=True)
class Reply:
    """A whole answer not sent yet (the proxy's own error, or an engine's 5xx held for a retry)."""

    status: int
    body: bytes
    headers: list[tuple[str | bytes, str | bytes]]

    def send(self, responder: Responder) -> None:
        responder.send(self.status, self.body, self.headers)


def error_response(status: int, message: str, err_type: str, code: str | int | None,
                   headers: Iterable[tuple[str | bytes, str | bytes]] = ()) -> Reply:
    return Reply(status, _JSON.encode(error_body(message, err_type, code)), [JSON_TYPE, *headers])


@dataclass(slots=True)
class Exchange:
    """One client request as the forwarder sees it."""

    request_id: str
    pool: str
    path_qs: str
    method: str
    body: bytes
    headers: list[tuple[bytes, bytes]]  # the client's, minus hop-by-hop ones, plus x-laswrr-request-id
    arrived: float  # perf_counter at handler entry
    tried: list[str] = field(default_factory=list)


@dataclass(slots=True)
class AttemptState:
    """What one attempt has done so far; read by the caller when the attempt is cancelled."""

    started: float
    sent: float | None = None  # upstream request issued
    first_byte: float | None = None  # first byte written to the client
    overhead: float = 0.0
    sse: Responder | None = None  # the client's SSE answer, once started


@dataclass(slots=True)
class Failed:
    """An attempt that failed before any byte reached the client (retryable)."""

    reason: str
    status: int | None = None
    response: Reply | None = None  # the engine's 5xx, passed through if no retry is left

    def to_response(self, node: str) -> Reply:
        if self.response is not None:
            return self.response
        if self.reason.startswith("timeout"):
            return error_response(504, f"upstream node {node} timed out: {self.reason}", SSE_ERROR_TYPE, "upstream_timeout")
        return error_response(502, f"upstream node {node} failed: {self.reason}", SSE_ERROR_TYPE, "upstream_unreachable")


@dataclass(slots=True)
class Done:
    attempt: Attempt


class Body(Protocol):
    """An engine's answer as the forwarder reads it (``UpstreamResponse`` or ``AiohttpAnswer``)."""

    status: int
    content_type: str
    headers: list[tuple[bytes, bytes]]

    async def read(self) -> bytes: ...

    async def readany(self) -> bytes: ...

    @property
    def at_eof(self) -> bool: ...

    def close(self) -> None: ...


class AiohttpAnswer:
    """An aiohttp client response behind the ``Body`` interface (non-http:// engines)."""

    __slots__ = ("content_type", "headers", "status", "up")

    def __init__(self, up: aiohttp.ClientResponse) -> None:
        self.up = up
        self.status = up.status
        self.content_type = up.content_type
        self.headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in up.headers.items()]

    async def read(self) -> bytes:
        return await self.up.read()

    async def readany(self) -> bytes:
        return await self.up.content.readany()

    @property
    def at_eof(self) -> bool:
        return self.up.content.at_eof()

    def close(self) -> None:
        self.up.close()


@dataclass(frozen=True, slots=True)
class Target:
    """Where an engine URL points: parsed once per URL."""

    host: str
    port: int
    host_header: str
    base_path: str  # without a trailing slash


class Forwarder:
    def __init__(self, session: aiohttp.ClientSession, router: Router, events: EventPublisher,
                 metrics: ProxyMetrics, max_retries: int, timeout: aiohttp.ClientTimeout,
                 aborting: Callable[[], bool], pool: UpstreamPool | None = None) -> None:
        self.session = session
        self.pool = pool
        self.targets: dict[str, Target | None] = {}
        self.router = router
        self.events = events
        self.metrics = metrics
        self.max_retries = max_retries
        self.timeout = timeout
        self.aborting = aborting

    async def forward(self, responder: Responder, ex: Exchange, admission: Admission) -> None:
        """Run attempts until one answers or retries run out; ``admission`` is the first node."""
        attempt_no = 0
        while True:
            rid = ex.request_id if attempt_no == 0 else f"{ex.request_id}.{attempt_no}"
            ex.tried.append(admission.node)
            result = await self._attempt_with_events(responder, ex, admission, rid)
            if isinstance(result, Done):
                return
            nxt = self.router.admit(ex.pool, ex.tried) if attempt_no < self.max_retries else None
            prefix = RETRIED_PREFIX if nxt is not None else ""
            self._finish(rid, admission, Attempt(outcome="upstream_error", status=result.status,
                                                 duration_ms=_ms(time.perf_counter() - ex.arrived),
                                                 error=prefix + result.reason))
            if nxt is None:
                reply = result.to_response(admission.node)
                reply.headers.extend(self._tags(admission, ex))
                reply.send(responder)  # ConnectionResetError: the client is gone, nothing to tell
                return
            self.metrics.retries.labels(pool=ex.pool).inc()
            admission, attempt_no = nxt, attempt_no + 1

    async def _attempt_with_events(self, responder: Responder, ex: Exchange, admission: Admission,
                                   rid: str) -> Done | Failed:
        self.events.started(rid, admission.node, admission.pool, admission.snapshot_seq)
        self.metrics.started(admission.node)
        state = AttemptState(started=time.perf_counter())
        try:
            result = await self._attempt(responder, ex, admission, state)
        except asyncio.CancelledError:
            aborted = self.aborting()
            outcome = "router_aborted" if aborted else "client_cancelled"
            self._finish(rid, admission, self._record(ex, state, outcome, None, error="cancelled"))
            if aborted and state.sse is not None:
                await _tell_aborted(state.sse)
            raise
        finally:
            self.router.release(admission)
            self.metrics.ended(admission.node)
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
    def _tags(admission: Admission, ex: Exchange) -> tuple[tuple[str, str], tuple[str, str]]:
        return (NODE_HEADER, admission.node), (REQUEST_ID_HEADER, ex.request_id)

    # -- one attempt ----------------------------------------------------------------------------

    def _target(self, url: str) -> Target | None:
        """``url`` parsed (cached); None when the pool cannot reach it (not plain http://)."""
        try:
            return self.targets[url]
        except KeyError:
            pass
        target = None
        parts = urlsplit(url)
        if self.pool is not None and parts.scheme == "http" and parts.hostname:
            port = parts.port or 80
            host = parts.hostname
            host_header = f"[{host}]" if ":" in host else host
            target = Target(host=host, port=port, host_header=host_header if port == 80 else f"{host_header}:{port}",
                            base_path=parts.path.rstrip("/"))
        if len(self.targets) > 10_000:
            self.targets.clear()
        self.targets[url] = target
        return target

    async def _send(self, ex: Exchange, admission: Admission) -> Body:
        target = self._target(admission.url)
        if target is None or self.pool is None:
            headers = CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in ex.headers)
            up = await self.session.request(ex.method, upstream_url(admission.url, ex.path_qs), data=ex.body,
                                            headers=headers, timeout=self.timeout)
            return AiohttpAnswer(up)
        head = request_head(ex.method, upstream_url(target.base_path, ex.path_qs), target.host_header, ex.headers,
                            b"", len(ex.body))
        return await self.pool.request(target.host, target.port, head, ex.body)

    async def _attempt(self, responder: Responder, ex: Exchange, admission: Admission,
                       state: AttemptState) -> Done | Failed:
        state.sent = time.perf_counter()
        state.overhead = state.sent - ex.arrived
        try:
            up = await self._send(ex, admission)
        except UPSTREAM_ERRORS as exc:
            return Failed(reason=describe(exc))
        try:
            if up.status >= 500:
                return await self._failed_status(up, admission, ex)
            if up.content_type == "text/event-stream":
                return await self._stream(responder, ex, admission, state, up)
            return await self._buffered(responder, ex, admission, state, up)
        finally:
            up.close()  # no-op after a full read; on cancel or error it aborts the engine's work

    async def _failed_status(self, up: Body, admission: Admission, ex: Exchange) -> Failed:
        try:
            body = await up.read()
        except UPSTREAM_ERRORS:
            body = b""
        reply = Reply(up.status, body, pass_headers(up.headers))
        return Failed(reason=f"HTTP {up.status}", status=up.status, response=reply)

    async def _buffered(self, responder: Responder, ex: Exchange, admission: Admission, state: AttemptState,
                        up: Body) -> Done | Failed:
        try:
            body = await up.read()
        except UPSTREAM_ERRORS as exc:
            return Failed(reason=describe(exc), status=up.status)
        received = time.perf_counter()
        headers = pass_headers(up.headers)
        headers.extend(self._tags(admission, ex))
        try:
            responder.send(up.status, body, headers)
        except ConnectionResetError as exc:
            return Done(self._record(ex, state, "client_cancelled", up.status, error=describe(exc)))
        state.first_byte = time.perf_counter()
        state.overhead += state.first_byte - received
        usage = usage_from_json(body) if up.content_type == "application/json" else (None, None)
        return Done(self._record(ex, state, "completed", up.status, usage))

    async def _stream(self, responder: Responder, ex: Exchange, admission: Admission, state: AttemptState,
                      up: Body) -> Done | Failed:
        try:
            first = await up.readany()
        except UPSTREAM_ERRORS as exc:
            return Failed(reason=describe(exc), status=up.status)
        received = time.perf_counter()
        headers = pass_headers(up.headers)
        headers.extend(self._tags(admission, ex))
        tail: deque[bytes] = deque(maxlen=_TAIL_CHUNKS)
        try:
            await responder.start(up.status, headers)
            state.sse = responder
            whole = up.at_eof  # the engine's whole stream is in hand: one write for all of it
            await responder.write(first, last=whole)
            tail.append(first)
            state.first_byte = time.perf_counter()
            state.overhead += state.first_byte - received
            error = None if whole else await self._pump(up, responder, tail)
            if error is not None:
                await responder.write(sse_error(f"upstream node {admission.node} failed mid-stream: {error}"))
            await responder.end()
        except ConnectionResetError as exc:
            return Done(self._record(ex, state, "client_cancelled", up.status, error=describe(exc)))
        if error is not None:
            return Done(self._record(ex, state, "upstream_error", up.status, error=error))
        return Done(self._record(ex, state, "completed", up.status, usage_from_sse(b"".join(tail))))

    @staticmethod
    async def _pump(up: Body, response: Responder, tail: deque[bytes]) -> str | None:
        """Copy the rest of the stream as it arrives; the upstream error that cut it, if any."""
        readany = up.readany
        while True:
            try:
                chunk = await readany()
            except UPSTREAM_ERRORS as exc:
                return describe(exc)
            if not chunk:
                return None
            await response.write(chunk)  # ConnectionResetError here means the client went away
            tail.append(chunk)


async def _tell_aborted(response: Responder) -> None:
    """Best effort: end an SSE stream cut by shutdown with an error event, not silently (never waits)."""
    response.cut(sse_error("proxy shut down before the stream ended"))


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def upstream_url(base: str, path_qs: str) -> str:
    base = base.rstrip("/")
    if base.endswith("/v1") and path_qs.startswith("/v1/"):
        base = base[:-3]
    return base + path_qs


def forward_headers(raw_headers: Iterable[tuple[bytes, bytes]], request_id: str) -> list[tuple[bytes, bytes]]:
    """The client's headers (aiohttp's ``raw_headers``) minus hop-by-hop ones, plus the request id."""
    out = [(k, v) for k, v in raw_headers if k.lower() not in _REQUEST_DROP_BYTES]
    out.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
    return out


def pass_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[str | bytes, str | bytes]]:
    """The engine's headers minus hop-by-hop ones and the length (the proxy frames the answer itself)."""
    return [(k, v) for k, v in headers if k.lower() not in _RESPONSE_DROP_BYTES]


def describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return f"timeout ({type(exc).__name__})"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]


def sse_error(message: str) -> bytes:
    return b"data: " + json.dumps(error_body(message, SSE_ERROR_TYPE, 502)).encode() + b"\n\n"


class _UsageHolder(msgspec.Struct):
    """Only ``usage`` of an answer is kept (as raw JSON); msgspec skips the rest without building it."""

    usage: msgspec.Raw = msgspec.Raw(b"null")


_HOLDER = msgspec.json.Decoder(_UsageHolder)
_USAGE = msgspec.json.Decoder()


def _usage_in(payload: bytes) -> tuple[int | None, int | None] | None:
    """(prompt, completion) tokens from a JSON object's ``usage``; None when it has none."""
    try:
        usage = _USAGE.decode(_HOLDER.decode(payload).usage)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (prompt if isinstance(prompt, int) and prompt >= 0 else None,
            completion if isinstance(completion, int) and completion >= 0 else None)


def usage_from_json(body: bytes) -> tuple[int | None, int | None]:
    return _usage_in(body) or (None, None)


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
        found = _usage_in(payload)
        if found is not None or seen >= 3:
            return found or (None, None)
    return None, None
