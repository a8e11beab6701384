"""One client request and its attempts as the forwarder sees them (services/proxy/upstream.py):
the request, what the client was sent, and how each attempt ended, typed for
``scheduler.routing.attempts`` (``outcome_of``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web
from multidict import CIMultiDict

from laswrr.scheduler.routing.latency import Objective
from laswrr.schemas.words import FailureKind, RequestOutcome
from laswrr.scheduler.routing.attempts import DONE, Outcome
from laswrr.scheduler.routing.continuation import StreamText
from laswrr.services.proxy.answers import failure_response
from laswrr.services.proxy.events import RETRIED_PREFIX, Attempt


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
    objective: Objective | None = None  # its latency targets (lb.req.started), None: none

    def avoid(self) -> list[str]:
        """The nodes a retry or continuation may not go to: tried, or not serving the model."""
        return [*self.tried, *self.exclude] if self.exclude else self.tried

    @property
    def base(self) -> bytes:
        """The body the next attempt (or pair) starts from: the client's, or the continuation after a break."""
        return self.body if self.continuation is None else self.continuation


@dataclass(slots=True)
class AttemptState:
    """What one attempt has done so far; read by the caller when the attempt is cancelled."""

    started: float
    sent: float | None = None  # upstream request issued
    first_byte: float | None = None  # first byte of this attempt written to the client
    overhead: float = 0.0
    status: int | None = None  # the engine's status, once its answer's head is in
    streaming: bool = False  # the engine's first body chunk came (a decode leg: its KV is there)
    partner_failed: Failed | None = None  # why the driver cancels it (an sglang decode leg: its prefill leg failed)


@dataclass(slots=True)
class Failed:
    """An attempt that failed before any byte of it reached the client (retryable unless said)."""

    kind: FailureKind
    reason: str  # for people: the finished event's ``error``
    status: int | None = None
    response: web.Response | None = None  # the engine's answer, passed through if no retry is left
    retryable: bool = True
    partner: bool = False  # a decode leg that failed for its pair's prefill leg (its node is not at fault)

    def to_response(self, node: str) -> web.Response:
        return self.response if self.response is not None else failure_response(self.kind, node, self.reason)

    def error(self, retried: bool) -> str:
        """The finished event's ``error``: the reason, marked when another attempt follows."""
        return RETRIED_PREFIX + self.reason if retried else self.reason

    def outcome(self) -> RequestOutcome:
        """The failed attempt's recorded outcome: a prefill leg's 4xx answer is ``engine_error``, any other
        failure ``upstream_error``."""
        return RequestOutcome.ENGINE_ERROR if self.kind is FailureKind.ENGINE_REFUSED else RequestOutcome.UPSTREAM_ERROR


@dataclass(slots=True)
class Broken:
    """A continuable stream that broke after the client got part of it; ``attempt`` is its record."""

    attempt: Attempt


@dataclass(slots=True)
class Done:
    response: web.StreamResponse
    attempt: Attempt


Result = Done | Failed | Broken


def outcome_of(result: Result) -> Outcome:
    """The attempt's outcome for ``scheduler.routing.attempts.decide``."""
    if isinstance(result, Done):
        return DONE
    if isinstance(result, Broken):
        return Outcome.BROKEN
    if not result.retryable:
        return Outcome.REFUSED
    return Outcome.PARTNER_FAILED if result.partner else Outcome.FAILED


def ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)
