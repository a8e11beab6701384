"""How the proxy answers each refusal cause: one table from ``RefusalCause`` to the HTTP status,
the OpenAI-style error ``type`` and ``code`` of its body (``{"error": {message, type, code}}``).

The ``code`` is the cause's own word (what ``lb.req.refused`` records) except where OpenAI's API
has its own code for the same answer (``rate_limit_exceeded``, ``model_not_found``) or the
proxy's answer predates the cause's word (``request_timeout``, ``shutting_down``).
"""

from __future__ import annotations

from typing import NamedTuple

from laswrr.schemas.words import RefusalCause as C

__all__ = ["ANSWERS", "Answer"]


class Answer(NamedTuple):
    status: int
    type: str  # the OpenAI-style error type
    code: str


_BAD = "invalid_request_error"
_BUSY = "service_unavailable"

ANSWERS: dict[C, Answer] = {
    C.INVALID_API_KEY: Answer(401, _BAD, C.INVALID_API_KEY.value),
    C.KEY_MAX_INFLIGHT: Answer(429, "requests", "rate_limit_exceeded"),
    C.INVALID_JSON: Answer(400, _BAD, C.INVALID_JSON.value),
    C.BODY_TIMEOUT: Answer(408, _BAD, "request_timeout"),
    C.REQUEST_TOO_LARGE: Answer(413, _BAD, C.REQUEST_TOO_LARGE.value),
    C.UNKNOWN_MODEL: Answer(404, _BAD, "model_not_found"),
    C.NO_SNAPSHOT: Answer(503, _BUSY, C.NO_SNAPSHOT.value),
    C.NO_ROUTABLE_NODE: Answer(503, _BUSY, C.NO_ROUTABLE_NODE.value),
    C.STOPPING: Answer(503, _BUSY, "shutting_down"),
    C.INVALID_HEADER: Answer(400, _BAD, C.INVALID_HEADER.value),
    C.QUEUE_FULL: Answer(429, "requests", C.QUEUE_FULL.value),
    C.QUEUE_TIMEOUT: Answer(429, "requests", C.QUEUE_TIMEOUT.value),
    C.RATE_LIMIT_REQUESTS: Answer(429, "requests", C.RATE_LIMIT_REQUESTS.value),
    C.RATE_LIMIT_TOKENS: Answer(429, "tokens", C.RATE_LIMIT_TOKENS.value),
    C.SLO_UNMEETABLE: Answer(429, "requests", C.SLO_UNMEETABLE.value),
    C.CLIENT_DISCONNECTED: Answer(499, "", C.CLIENT_DISCONNECTED.value),  # nobody to answer: recorded only
}
