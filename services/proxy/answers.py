"""What the proxy sends its clients and engines besides the engines' own bytes: the headers it
strips and adds, its error bodies (JSON and the SSE error event), and the ``usage`` it reads from
answers (services/proxy/upstream.py, "never cut" rules)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import msgspec
from aiohttp import web
from multidict import CIMultiDict

from laswrr.schemas.words import FailureKind, RequestOutcome

NODE_HEADER = "x-laswrr-node"
REQUEST_ID_HEADER = "x-laswrr-request-id"
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})
REQUEST_DROP = tuple(HOP_BY_HOP | {"host", "content-length", "expect"})  # the body is already read
RESPONSE_DROP = tuple(HOP_BY_HOP | {"content-length"})
SSE_ERROR_TYPE = "upstream_error"

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


def failure_response(kind: FailureKind, node: str, reason: str) -> web.Response:
    """The proxy's answer for an attempt that failed with no engine answer to pass through."""
    if kind is FailureKind.TIMED_OUT:
        return error_response(504, f"upstream node {node} timed out: {reason}", SSE_ERROR_TYPE, "upstream_timeout")
    return error_response(502, f"upstream node {node} failed: {reason}", SSE_ERROR_TYPE, "upstream_unreachable")


def tag(response: web.StreamResponse, node: str, request_id: str) -> web.StreamResponse:
    """The engine's headers (copied into ``response``) minus what the proxy re-frames, plus ours."""
    strip(response.headers, RESPONSE_DROP)
    response.headers[NODE_HEADER] = node
    response.headers[REQUEST_ID_HEADER] = request_id
    return response


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


def failure_kind(exc: BaseException) -> FailureKind:
    """The kind of a transport failure (``describe`` is its text)."""
    return FailureKind.TIMED_OUT if isinstance(exc, asyncio.TimeoutError) else FailureKind.UNREACHABLE


def sse_error(message: str) -> bytes:
    return b"data: " + json.dumps(error_body(message, SSE_ERROR_TYPE, 502)).encode() + b"\n\n"


async def tell_aborted(response: web.StreamResponse) -> None:
    """Best effort: end an SSE stream cut by shutdown with an error event, not silently."""
    try:
        await asyncio.wait_for(response.write(sse_error("proxy shut down before the stream ended")), 0.5)
        await asyncio.wait_for(response.write_eof(), 0.5)
    except (asyncio.TimeoutError, ConnectionResetError, RuntimeError):
        pass


# read for every answer, as module constants (scheduler.routing.attempts: an enum member costs a lookup)
_COMPLETED, _ENGINE_ERROR = RequestOutcome.COMPLETED, RequestOutcome.ENGINE_ERROR


def answered(status: int) -> RequestOutcome:
    """The outcome of an engine's answer (below 500) that reached the client whole: ``completed``
    for a 2xx, ``engine_error`` for anything else (a 4xx, a 3xx): docs/wire.md, "Engine errors and the
    router's own answers"."""
    return _COMPLETED if 200 <= status < 300 else _ENGINE_ERROR


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
