"""An engine's error answer that is not JSON, as the OpenAI-style error a client expects.

Engines answer most errors with an OpenAI-style JSON body, which the proxy passes through as it
is. Some do not: aiohttp's own plain-text ``413 Request Entity Too Large`` (a body over the
engine's size limit), an HTML ``502`` from a gateway in front of the engine. ``as_openai_error``
turns such an answer (status >= 400, not ``application/json``) into ``{"error": {message, type,
code, param}}`` with the same status, the engine's text (cut) in the message, so every error a
client reads has one shape; a JSON answer, and any answer below 400, is returned unchanged.

Where it applies (services/proxy/attempt.py, ``AttemptRunner``): on the body of an engine's
answer before it is handed to the client, in ``_buffered`` and ``_failed_status``.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
from multidict import CIMultiDict

from laswrr.schemas.refusals import ANSWERS
from laswrr.schemas.words import RefusalCause

TEXT_MAX_CHARS = 300  # of the engine's own text kept in the message
# the type and code of the proxy's own answer with the same status, where there is one (413, 404)
CODES = {ANSWERS[cause].status: ANSWERS[cause] for cause in (RefusalCause.REQUEST_TOO_LARGE, RefusalCause.UNKNOWN_MODEL)}


def as_openai_error(status: int, content_type: str, body: bytes,
                    headers: Mapping[str, str]) -> tuple[bytes, Mapping[str, str]]:
    """``(body, headers)`` to send the client for the engine's answer (module header)."""
    if status < 400 or content_type == "application/json":
        return body, headers
    text = " ".join(body.decode("utf-8", errors="replace").split())
    if len(text) > TEXT_MAX_CHARS:
        text = text[:TEXT_MAX_CHARS] + "…"
    own = CODES.get(status)
    kind = own.type if own else "invalid_request_error" if status < 500 else "api_error"
    message = f"the engine answered HTTP {status}" + (f": {text}" if text else "")
    new_body = msgspec.json.encode({"error": {"message": message, "type": kind, "code": own.code if own else None,
                                              "param": None}})
    new_headers = CIMultiDict(headers)
    for name in ("Content-Type", "Content-Length", "Content-Encoding"):
        new_headers.popall(name, None)
    new_headers["Content-Type"] = "application/json"
    return new_body, new_headers
