"""The proxy's HTTP face (aiohttp): OpenAI-compatible routes, probes, metrics, graceful stop.

Routes. Every OpenAI-compatible POST route the engines serve (``OPENAI_POST_ROUTES``:
``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``, ``/v1/responses``,
``/v1/rerank``, ``/v1/score``, ``/tokenize``, ``/detokenize``, plus ``ProxyConfig.extra_routes``)
goes through one handler: the JSON body's ``model`` picks the pool, and admission, retries and
events are the same for all of them. ``GET /v1/models`` is the union of the engines' lists
(``services.proxy.models``); ``GET /health`` and ``/healthz`` are liveness (200 while the
process serves, 503 while stopping; the body is ``health_report``), ``GET /readiness`` is 200
only while a snapshot is held and some pool has a routable node (503 with the reason
otherwise); ``GET /metrics`` is Prometheus text. Any other path answers 404 and a known path
with the wrong method 405 with ``Allow``, both as OpenAI-style JSON errors (``not_found``, a
catch-all route: no middleware on the request path).

Handlers hold no policy: they validate input (400 invalid JSON, a body that is not UTF-8
included, 413 body over ``max_body_bytes``, 408 a body not received within ``body_timeout_s``,
404 unknown model, 503 no snapshot yet or no routable node, all OpenAI-style
``{"error": {message, type, code}}``), pick the pool, ask the router for an admission and hand
over to ``upstream.Forwarder``.

Hostile clients. A connection that has not sent a complete request head for ``idle_timeout_s``
(idle between requests, or a slowloris trickling its headers byte by byte) is closed (aiohttp's
keep-alive timer, which also runs from the connection's start); a request line or header that
aiohttp's parser refuses (bytes not allowed in a path or a header name, a line over 8190 bytes,
more than 128 headers) gets its 400, and is logged as one throttled warning line
(``quiet_parser_errors``), not a traceback per request. Header values are passed through to the
engine as they came (HTTP allows any byte there); the one the proxy reads itself,
``Authorization`` with ``--api-keys``, is a 401 when it is not a key.

API keys (``--api-keys``, services/proxy/keys.py): every forwarded route and ``/v1/models``
first check ``Authorization: Bearer <key>`` (401 ``invalid_api_key``) and the key's requests in
flight (429 ``rate_limit_exceeded``); the key's name goes on ``lb.req.started`` and into
``/metrics``. ``--admin-port`` moves ``/metrics`` and the probes to a second listener (they
stay unauthenticated wherever they are: a load balancer probes them).

Model -> pool and nodes (``scheduler.routing.models``, from each node's ``NodeView.models``): a
pool with that exact name, forwarded as the id of the node each attempt goes to; else the pool
whose nodes list that model id, and only those nodes; else the pool ``default``, forwarded as
the picked node's id when its nodes serve one model id, the router's own 404 when they serve
several. The router never sends a node a model id it did not list.

Refusals. Every answer the proxy gives itself (401, 400, 408, 413, 404, 429, 503) is also an
``lb.req.refused.<proxy>`` event (``_refuse``: cause, status, the client's model and key name)
and counted in ``/metrics`` by cause and status class.

Server. aiohttp's low-level server (``web.Server``) with one handler, ``Dispatch``: a dict from
(method, path) to the handler, which is what the application router did here (exact paths,
HEAD with every GET, a catch-all for the rest) without resolving a route, building match info
or running the application's machinery per request; the request is aiohttp's ``BaseRequest``
(its C parser, ``client_max_size`` = ``max_body_bytes``), made by
``engine_client.request_factory``: constructing ``BaseRequest`` is one of aiohttp's private
parts, which all live in services/proxy/engine_client.py.

Lifecycle. ``build_state`` makes the proxy's state; ``_resources`` owns the engine transport
(``engine_client.EnginePool``: forwarded requests and the ``/v1/models`` listings), the NATS link (background
connect + LB_WEIGHTS watch), the event publisher and the heartbeat.
``start`` / ``RunningProxy.stop`` run them. A proxy that shares its port (``reuse_port``: a
worker of ``--workers N``, restarted beside workers that serve) listens only once it holds a
routing snapshot, for at most ``SNAPSHOT_WAIT_S``: the kernel gives a listening socket its share
of new connections, and before its first snapshot it could only answer them 503
``no_snapshot`` while the other workers could serve them (a proxy alone on its port listens at
once: its 503 is then the only answer there is). Stop closes the listening socket first, answers
the requests flow control holds (503 ``stopping``, ``Retry-After: 1``: ``FlowGate.hand_back``),
serves for up to ``DRAIN_S`` the requests still coming on open keep-alive connections, each
response saying ``Connection: close`` (a rolling restart of workers loses none: docs/runbook.md), lets
in-flight requests finish within ``grace_s`` (requests still running then are cancelled:
``router_aborted``), then publishes ``lb.proxy.stopped.<proxy>``, flushes the event buffer and
drains NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import msgspec
from aiohttp import web

from laswrr.services.natsbus import StreamLimits, Throttled
from laswrr.services.proxy.bus import BusLink
from laswrr.services.proxy.config import ProxyConfig
from laswrr.services.proxy.engine_client import EnginePool, HttpProcessingError, request_factory
from laswrr.services.proxy.events import EventPublisher
from laswrr.services.proxy.keys import NO_LIMITS, ApiKeys, UpstreamAuth
from laswrr.services.proxy.metrics import CONTENT_TYPE, ProxyMetrics
from laswrr.services.proxy.models import ModelCatalog
from laswrr.scheduler.routing.flow import NO_TENANT, FlowConfig, FlowError, band_of, ttl_s, work_of
from laswrr.scheduler.routing.latency import (TPOT_HEADER, TTFT_HEADER, LatencyModel, Objective, SloDefaults,
                                              SloError, slo_fields)
from laswrr.scheduler.routing.prompt import RequestSize, prompt_text, request_size
from laswrr.services.proxy.flow import FlowAnswer, FlowCollector, FlowGate
from laswrr.scheduler.routing.models import ModelPlan, Unknown, mixed_models, plan, pool_ids
from laswrr.scheduler.routing.router import AdmitRequest, Refusal, Router, scorer_for
from laswrr.schemas.outputs import WeightSnapshot
from laswrr.schemas.refusals import ANSWERS
from laswrr.schemas.words import Band, HoldCause, RefusalCause
from laswrr.services.tasks import stop_task
from laswrr.services.proxy.tokens import MIN_THREAD_CHARS, PromptTokenizer
from laswrr.services.proxy.upstream import (
    REQUEST_ID_HEADER,
    Exchange,
    Forwarder,
    error_body,
    error_response,
    forward_headers,
)

log = logging.getLogger("laswrr.proxy")

EVENT_FLUSH_TIMEOUT_S = 5.0
PRIORITY_HEADER = "x-laswrr-priority"  # interactive | default | batch (scheduler.routing.flow.band_of)
TTL_HEADER = "x-laswrr-ttl-ms"  # how long flow control may hold the request
DRAIN_S = 1.0  # at a stop: how long open keep-alive connections may still bring requests
SNAPSHOT_WAIT_S = 10.0  # a proxy sharing its port waits this long at most for a snapshot before it listens
MODEL_CHARS = 256  # of a request's "model", kept on its lb.req.refused event
PLANS_KEPT = 256  # model names whose plan is kept (_plan), each of at most MODEL_CHARS characters


class RequestPeek(msgspec.Struct):
    """The only fields the proxy reads from a request body; the body itself is forwarded as is.
    ``messages``/``prompt`` and the output limits feed prefix affinity (``scheduler.routing.prompt``)."""

    model: str | None = None
    messages: Any = None
    prompt: Any = None
    max_tokens: Any = None
    max_completion_tokens: Any = None


_PEEK = msgspec.json.Decoder(RequestPeek)

OPENAI_POST_ROUTES: tuple[str, ...] = (
    "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/v1/rerank", "/v1/score",
    "/tokenize", "/detokenize",
)


@dataclass
class ProxyState:
    config: ProxyConfig
    router: Router
    events: EventPublisher
    metrics: ProxyMetrics
    bus: BusLink
    keys: ApiKeys | None = None
    upstream_auth: UpstreamAuth = field(default_factory=UpstreamAuth)
    forwarder: Forwarder | None = None
    catalog: ModelCatalog | None = None
    flow: FlowGate | None = None  # --flow-control
    slo: SloDefaults = field(default_factory=SloDefaults)  # --slo-default: targets of requests without the headers
    tokens: PromptTokenizer | None = None  # --tokenizer: the exact cache view's tokens of a request
    stopping: bool = False
    aborting: bool = False
    active: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    handlers: set[asyncio.Task[object]] = field(default_factory=set)
    ids: count[int] = field(default_factory=lambda: count(1))
    models_seen: dict[str, tuple[WeightSnapshot, Any]] = field(default_factory=dict)  # pool -> (snapshot, mixed ids)
    # model -> its plan as of plans_views, and the catalog's hint it was made with (None: none asked)
    plans: dict[str | None, tuple[ModelPlan | Unknown, dict[str, str] | None]] = field(default_factory=dict)
    plans_views: int = -1  # the router's ``views`` the plans were made on

    def next_request_id(self) -> str:
        return f"{self.config.proxy_id}-{self.events.boot_id}-{next(self.ids)}"


Handler = Callable[[web.BaseRequest, ProxyState], Awaitable[web.StreamResponse]]


# -- handlers ----------------------------------------------------------------------------------

async def forward_by_model(request: web.BaseRequest, state: ProxyState) -> web.StreamResponse:
    """Every OpenAI POST route: the body's ``model`` picks the pool; then admission and forwarding."""
    arrived = time.perf_counter()
    if state.aborting:  # while stopping, requests on open connections are served (RunningProxy.stop)
        state.metrics.count_response(503)
        return _refuse(state, RefusalCause.STOPPING, "proxy is shutting down", headers={"Retry-After": "1", "Connection": "close"})
    key_name = None
    if state.keys is not None:
        key_name = state.keys.identify(request.headers.get("Authorization"))
        refused = _refuse_key(state, state.keys, key_name)
        if refused is not None:
            return refused
    state.active += 1
    state.idle.clear()
    task = asyncio.current_task()
    if task is not None:
        state.handlers.add(task)
    try:
        response = await _forward(request, state, arrived, key_name)
        state.metrics.count_response(response.status)
        return response
    finally:
        state.handlers.discard(task)  # type: ignore[arg-type]
        state.active -= 1
        if state.active == 0:
            state.idle.set()
        if key_name is not None and state.keys is not None:
            state.keys.release(key_name)


def _refuse(state: ProxyState, cause: RefusalCause, message: str, headers: dict[str, str] | None = None, pool: str | None = None, model: str | None = None,
            key_name: str | None = None, param: str | None = None, request_id: str | None = None) -> web.Response:
    """The proxy answers a request itself (``status``, an OpenAI-style error): counted in
    ``/metrics`` by cause and status class, and recorded as ``lb.req.refused.<proxy>`` with a
    request id of its own (or ``request_id``: a held request's, named by its ``lb.req.queued``),
    which the answer names in ``x-laswrr-request-id``."""
    request_id = request_id or state.next_request_id()
    status, err_type, code = ANSWERS[cause]
    state.metrics.count_refusal(cause, status)
    state.events.refused(request_id, status, cause, message, pool=pool, model=model, key_name=key_name)
    body = error_body(message, err_type, code)
    body["error"]["param"] = param
    return web.json_response(body, status=status, headers={**(headers or {}), REQUEST_ID_HEADER: request_id})


def _objective(state: ProxyState, request: web.BaseRequest, key_name: str | None) -> Objective | None:
    """The request's latency targets: its headers, else its key's or band's ``--slo-default``."""
    headers = request.headers
    ttft, tpot = headers.get(TTFT_HEADER), headers.get(TPOT_HEADER)
    defaults = state.slo
    if ttft is None and tpot is None and not defaults.bands and not defaults.keys:
        return None
    try:
        band = band_of(headers.get(PRIORITY_HEADER))
    except FlowError:
        band = Band.DEFAULT  # flow control answers the header; the targets take the default band's
    return defaults.objective(ttft, tpot, band, key_name)


def _unmeetable(state: ProxyState, refusal: Refusal, pool: str, model: str | None, key_name: str | None,
                request_id: str | None = None) -> web.Response:
    """429 ``slo_unmeetable``: no node is predicted to meet the request's targets, even idle;
    the answer and its ``lb.req.refused`` carry the targets and the best prediction."""
    cause = RefusalCause.SLO_UNMEETABLE
    objective, predicted = refusal.objective, refusal.predicted
    figures = {**slo_fields(objective, predicted)}
    message = f"no node of pool {pool!r} is predicted to meet the request's latency objective: " + \
        ", ".join(f"{name} {value:g}" for name, value in figures.items())
    request_id = request_id or state.next_request_id()
    status, err_type, code = ANSWERS[cause]
    state.metrics.count_refusal(cause, status)
    state.events.refused(request_id, status, cause, message, pool=pool, model=model, key_name=key_name,
                         objective=objective, predicted=predicted, estimate=refusal.estimate)
    return web.json_response(error_body(message, err_type, code), status=status,
                             headers={REQUEST_ID_HEADER: request_id})


async def _tokenize(tokenizer: PromptTokenizer, peek: RequestPeek, chars: int) -> list[int] | None:
    """The request's engine tokens (``services.proxy.tokens``), in a thread for a long prompt."""
    if chars < MIN_THREAD_CHARS:
        return tokenizer.encode(peek.messages, peek.prompt)
    return await asyncio.to_thread(tokenizer.encode, peek.messages, peek.prompt)


def _refuse_key(state: ProxyState, keys: ApiKeys, key_name: str | None) -> web.Response | None:
    """None when the request may go on (its key now counted in flight); else the 401 or 429 to answer."""
    if key_name is None:
        state.metrics.count_response(401)
        return _refuse(state, RefusalCause.INVALID_API_KEY,
                       "Incorrect or missing API key: send Authorization: Bearer <key>", headers={"WWW-Authenticate": "Bearer"})
    if not keys.acquire(key_name):
        state.metrics.count_response(429)
        return _refuse(state, RefusalCause.KEY_MAX_INFLIGHT,
                       f"Rate limit reached: {keys.max_inflight} requests in flight for this key", headers={"Retry-After": "1"}, key_name=key_name)
    return None


async def _forward(request: web.BaseRequest, state: ProxyState, arrived: float,
                   key_name: str | None = None) -> web.StreamResponse:
    body_or_error = await _read_body(request, state, key_name)
    if isinstance(body_or_error, web.Response):
        return body_or_error
    body = body_or_error
    try:
        peek = _PEEK.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return _refuse(state, RefusalCause.INVALID_JSON, f"invalid JSON body: {exc}", key_name=key_name)
    router = state.router
    model = None if peek.model is None else peek.model[:MODEL_CHARS]
    if not router.table.names():  # cold start with NATS not (yet) reachable: nothing to route on
        return _refuse(state, RefusalCause.NO_SNAPSHOT, "no routing snapshot yet (is the scheduler running?)",
                       headers={"Retry-After": "1"}, model=model,
                       key_name=key_name)
    decision = await _plan(state, peek.model)
    if isinstance(decision, Unknown):
        return _refuse(state, RefusalCause.UNKNOWN_MODEL, _unknown_model(decision, router), pool=decision.pool, model=model,
                       key_name=key_name, param="model")
    pool = decision.pool
    text = prompt_text(peek.messages, peek.prompt)
    size = request_size(text, peek.max_tokens, peek.max_completion_tokens)
    tokens = None
    kv = router.table.kv
    if state.tokens is not None and text and any(kv.exact(n) for n in router.table.candidates(pool)):
        # some node of the pool has an exact view (its engine publishes its KV events)
        tokens = await _tokenize(state.tokens, peek, len(text))
        if tokens is not None:
            size = RequestSize(len(tokens), size.max_tokens)
    stagger = router.stagger_s(pool)
    if stagger:  # replicas pick one burst in turn, each after hearing the others' picks (Router.stagger_s)
        await asyncio.sleep(stagger)
    try:
        objective = _objective(state, request, key_name)
    except SloError as exc:
        return _refuse(state, RefusalCause.INVALID_HEADER, str(exc), pool=pool, model=model, key_name=key_name)
    gate = state.flow
    if gate is not None:
        return await _flow_forward(request, state, gate, arrived, key_name, pool, body, text, size, decision, model,
                                   objective, tokens)
    admission = router.admitter.admit(AdmitRequest(pool, decision.exclude, text, size, objective=objective,
                                                   tokens=tokens))
    state.bus.picked()
    if isinstance(admission, Refusal) and admission.cause is RefusalCause.SLO_UNMEETABLE:
        return _unmeetable(state, admission, pool, model, key_name)
    if isinstance(admission, Refusal):
        serving = f" serving `{peek.model}`" if decision.exclude else ""
        why = f"every routable node{serving} is at its in-flight cap" if admission.saturated else \
            f"no routable node{serving}"
        return _refuse(state, admission.cause, f"{why} in pool {pool!r}", headers={"Retry-After": "1"}, pool=pool, model=model, key_name=key_name)
    request_id = state.next_request_id()
    headers = forward_headers(request.headers, request_id)
    state.upstream_auth.apply(headers)
    exchange = Exchange(request_id=request_id, pool=pool, path_qs=request.path_qs, method=request.method, body=body,
                        headers=headers, arrived=arrived, key_name=key_name, exclude=decision.exclude,
                        alias=peek.model if decision.alias else None, objective=objective)
    assert state.forwarder is not None
    return await state.forwarder.forward(request, exchange, admission)


async def _flow_forward(request: web.BaseRequest, state: ProxyState, gate: FlowGate, arrived: float,
                        key_name: str | None, pool: str, body: bytes, text: bytes,
                        size: RequestSize, decision: ModelPlan, model: str | None,
                        objective: Objective | None = None,
                        tokens: list[int] | None = None) -> web.StreamResponse:
    """With flow control (services/proxy/flow.py): the request's band, TTL and work, the key's rate
    limits, then admission now or after being held (only on nodes serving its model: ``decision``);
    the slot goes to the next held request when done. Its refusals are ``lb.req.refused`` too."""
    limits = state.keys.limits_of(key_name) if state.keys is not None else NO_LIMITS
    try:
        band = band_of(request.headers.get(PRIORITY_HEADER), limits.max_band)
        ttl = ttl_s(request.headers.get(TTL_HEADER), gate.ttl_default_s, gate.ttl_max_s)
    except FlowError as exc:
        return _refuse(state, RefusalCause.INVALID_HEADER, str(exc), pool=pool, model=model, key_name=key_name)
    if objective is not None and objective.ttft_ms is not None:  # held only while its TTFT target can be met
        ttl = min(ttl, objective.ttft_ms / 1000)
    work = work_of(size.prompt_tokens, size.max_tokens, gate.queue.config.default_max_tokens)
    request_id = state.next_request_id()  # one id from lb.req.queued to lb.req.started or lb.req.refused
    held: list[HoldCause] = []

    def on_hold(cause: HoldCause) -> None:
        held.append(cause)
        state.events.queued(request_id, pool, band, key_name, work, round(ttl * 1000), cause)

    result = gate.rates.charge(key_name, limits, work)
    if result is None:
        try:
            result = await gate.admit(pool, band, key_name or NO_TENANT, work, ttl, text, size, decision.exclude,
                                      on_hold, objective, tokens)
        except asyncio.CancelledError:
            if held:  # the client left while its request was held: recorded, nobody to answer
                gone = RefusalCause.CLIENT_DISCONNECTED
                state.metrics.count_refusal(gone, ANSWERS[gone].status)
                state.events.refused(request_id, ANSWERS[gone].status, gone,
                                     "the client closed its connection while the request was held", pool=pool,
                                     model=model, key_name=key_name)
            raise
    state.bus.picked()
    if isinstance(result, Refusal):
        return _unmeetable(state, result, pool, model, key_name, request_id)
    if isinstance(result, FlowAnswer):
        return _refuse(state, result.code, result.message, headers=dict(result.headers), pool=pool, model=model,
                       key_name=key_name, request_id=request_id)
    headers = forward_headers(request.headers, request_id)
    state.upstream_auth.apply(headers)
    exchange = Exchange(request_id=request_id, pool=pool, path_qs=request.path_qs, method=request.method, body=body,
                        headers=headers, arrived=arrived, key_name=key_name, exclude=decision.exclude,
                        alias=model if decision.alias else None, objective=objective)
    assert state.forwarder is not None
    try:
        return await state.forwarder.forward(request, exchange, result)
    finally:
        gate.released(pool)
        state.bus.picked()  # a held request may have taken the slot
        gate.rates.settle(key_name, limits, work, exchange.used_tokens)


async def _plan(state: ProxyState, model: str | None) -> ModelPlan | Unknown:
    """The request's pool, eligible nodes and model rewriting (``scheduler.routing.models``), from
    the snapshots' model lists; the proxy's ``/v1/models`` cache is asked only for a name no
    snapshot lists (nodes the collector has not listed). A plan is kept until a snapshot is
    installed or a pool forgotten (``Router.views``), for at most ``PLANS_KEPT`` names (any a
    client sends); one made with the cache's answer only while the cache holds that answer
    (``ModelCatalog.pool_hint`` returns a new mapping at each refresh)."""
    table = state.router.table
    if state.plans_views != table.views:
        state.plans.clear()
        state.plans_views = table.views
        _warn_mixed(state, table.snapshots())
    kept = state.plans.get(model)
    if kept is not None:
        decision, used = kept
        if used is None or (state.catalog is not None and await state.catalog.pool_hint() is used):
            return decision
    snapshots = table.snapshots()
    hint = None
    if (model is not None and model not in snapshots and state.catalog is not None
            and not any(model in pool_ids(snapshot.nodes) for snapshot in snapshots.values())):
        hint = await state.catalog.pool_hint()
    decision = plan(snapshots, model, hint)
    if state.plans_views == table.views and (model is None or len(model) <= MODEL_CHARS):
        if len(state.plans) >= PLANS_KEPT:
            state.plans.clear()
        state.plans[model] = (decision, hint)
    return decision


def _warn_mixed(state: ProxyState, snapshots: dict[str, WeightSnapshot]) -> None:
    """Log once per change when a pool's nodes list different model ids (``laswrr nodes`` shows
    it too); each snapshot is looked at once."""
    for pool, snapshot in snapshots.items():
        seen = state.models_seen.get(pool)
        if seen is not None and seen[0] is snapshot:
            continue
        mixed = mixed_models(snapshot)
        key = tuple(sorted((node, tuple(ids)) for node, ids in (mixed or {}).items()))
        changed = seen is None or seen[1] != key
        state.models_seen[pool] = (snapshot, key)
        if changed:
            if mixed:
                log.warning("pool %s mixes model ids: %s; a pool name goes to every node as its own id, a model id "
                            "only to the nodes listing it", pool,
                            "; ".join(f"{node}: {', '.join(ids)}" for node, ids in sorted(mixed.items())))


async def _read_body(request: web.BaseRequest, state: ProxyState,
                     key_name: str | None = None) -> bytes | web.Response:
    limit = state.config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        return _too_large(state, limit, key_name)
    try:
        if request.content.is_eof():  # the usual case: the whole body came with the head, nothing to wait for
            body = await request.read()
        else:
            async with asyncio.timeout(state.config.body_timeout_s):  # no task per request, unlike wait_for
                body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _too_large(state, limit, key_name)
    except asyncio.TimeoutError:
        return _refuse(state, RefusalCause.BODY_TIMEOUT,
                       f"request body not received within {state.config.body_timeout_s:g} s", headers={"Connection": "close"}, key_name=key_name)
    if not body.isascii():  # JSON is UTF-8 (RFC 8259): a field the peek skips must be too
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            return _refuse(state, RefusalCause.INVALID_JSON, f"invalid JSON body: not UTF-8 at byte {exc.start}",
                           key_name=key_name)
    return body


class quiet_parser_errors(logging.Filter):
    """On aiohttp's server logger: a request its HTTP parser refused (answered 400 by aiohttp)
    becomes one throttled warning line instead of an ERROR with a traceback per request, so
    a client sending garbage cannot flood the log. Everything else passes unchanged."""

    throttled = Throttled(logging.getLogger("laswrr.proxy.http"))

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        reason = " ".join(str(exc.message).split())[:200]
        self.throttled.failed("refused malformed HTTP requests (400), e.g. %s", reason)
        return False


_QUIET = quiet_parser_errors()


def _too_large(state: ProxyState, limit: int, key_name: str | None) -> web.Response:
    return _refuse(state, RefusalCause.REQUEST_TOO_LARGE, f"request body exceeds the {limit}-byte limit", headers={"Connection": "close"}, key_name=key_name)


def _unknown_model(unknown: Unknown, router: Router) -> str:
    pools = ", ".join(sorted(router.table.names())) or "none yet"
    if unknown.model is None:
        return f"no model given and no pool 'default' (pools: {pools})"
    if unknown.ids:
        return (f"The model `{unknown.model}` does not exist: no node of pool {unknown.pool!r} serves it "
                f"(its nodes serve: {', '.join(unknown.ids)}; pools: {pools})")
    return f"The model `{unknown.model}` does not exist (pools: {pools})"


async def list_models(request: web.BaseRequest, state: ProxyState) -> web.Response:
    if state.keys is not None:
        key_name = state.keys.identify(request.headers.get("Authorization"))
        if key_name is None:
            refused = _refuse_key(state, state.keys, key_name)
            assert refused is not None
            return refused
    assert state.catalog is not None
    return web.json_response(await state.catalog.listing())


async def healthz(request: web.BaseRequest, state: ProxyState) -> web.Response:
    """Liveness (``/health``, ``/healthz``): 200 while the process serves, 503 while it stops."""
    body = health_report(state)
    return web.json_response(body, status=503 if state.stopping else 200)


async def readiness(request: web.BaseRequest, state: ProxyState) -> web.Response:
    """Readiness: 200 only with a snapshot held and a routable node in some pool; else 503 and why."""
    reason = not_ready_reason(state)
    if reason is None:
        return web.json_response({"status": "ready", "proxy": state.config.proxy_id})
    return web.json_response({"status": "not_ready", "reason": reason, "proxy": state.config.proxy_id}, status=503)


def not_ready_reason(state: ProxyState) -> str | None:
    table = state.router.table
    if state.stopping:
        return "stopping"
    if not table.names():
        return "no_snapshot"
    if not any(table.candidates(pool) for pool in table.names()):
        return "no_routable_node"
    return None


async def not_found(request: web.BaseRequest, allowed_by_path: dict[str, tuple[str, ...]]) -> web.Response:
    """The catch-all: 405 with ``Allow`` on a known path, else 404; OpenAI-style JSON."""
    allowed = allowed_by_path.get(request.path)
    if allowed:
        return error_response(405, f"method {request.method} not allowed on {request.path} (allowed: "
                              f"{', '.join(allowed)})", "invalid_request_error", "method_not_allowed",
                              headers={"Allow": ", ".join(allowed)})
    return error_response(404, f"no route {request.path} (OpenAI routes: {', '.join(OPENAI_POST_ROUTES)}, "
                          "GET /v1/models)", "invalid_request_error", "not_found")


def health_report(state: ProxyState) -> dict[str, object]:
    now_ns, now = time.time_ns(), time.monotonic()
    pools = {}
    stale = not state.bus.connected
    table = state.router.table
    for name, route in sorted(table.routes()):
        snapshot = route.snapshot
        age = max(0.0, (now_ns - snapshot.ts_ns) / 1e9)
        stale = stale or age > state.config.stale_after_s
        pools[name] = {"as_of_seq": snapshot.as_of_seq, "tick": snapshot.tick, "age_s": round(age, 3),
                       "received_s_ago": round(now - route.received_at, 3), "panic": snapshot.panic,
                       "nodes": len(snapshot.nodes), "routable": sorted(table.candidates(name))}
    status = "stopping" if state.stopping else "no_snapshot" if not pools else "stale" if stale else "ok"
    report = {"status": status, "proxy": state.config.proxy_id, "policy": state.config.policy,
              "affinity": state.router.affinity_mode,
              "nats_connected": state.bus.connected, "inflight": table.load.total,
              "events_buffered": state.events.buffered, "events_dropped": state.events.dropped, "pools": pools}
    if state.tokens is not None:  # --tokenizer: which nodes the exact cache view holds, and which it lost
        kv = table.kv
        report["kv_view"] = {"exact": sorted(n for n in kv.nodes if kv.exact(n)),
                             "stale": sorted(n for n in kv.nodes if not kv.exact(n)), "rejected": state.bus.kv_rejected}
    feed = state.bus.latency
    if feed is not None:  # --share-latency: the LB_EVENTS sequence it learns from (None: its own attempts, yet)
        report["latency_shared"] = {"from_seq": None if feed.learner is None else feed.learner.model.source,
                                    "rejected": feed.rejected}
    return report


async def metrics(request: web.BaseRequest, state: ProxyState) -> web.Response:
    state.metrics.refresh(state.router, state.events, state.bus.connected, state.bus.view_lag,
                          state.bus.peers)
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


# -- resources ---------------------------------------------------------------------------------

async def _heartbeats(state: ProxyState) -> None:
    while True:
        await asyncio.sleep(state.config.heartbeat_s)
        table = state.router.table
        state.events.heartbeat(table.load.total, table.applied_seq())


@contextlib.asynccontextmanager
async def _resources(state: ProxyState) -> AsyncIterator[None]:
    config = state.config
    engines = EnginePool(config.connect_timeout_s, config.upstream_timeout_s, keepalive_s=30.0)
    state.catalog = ModelCatalog(engines, state.router, ttl_s=config.models_ttl_s, auth=state.upstream_auth)
    state.forwarder = Forwarder(engines, state.router, state.events, state.metrics, config.max_retries,
                                aborting=lambda: state.aborting, continue_limit=config.continue_limit,
                                stall_timeout_s=config.stall_timeout_s, catalog=state.catalog,
                                decode_only_tokens=config.pd_decode_only_tokens,
                                picked=lambda: state.bus.picked())
    publisher = asyncio.create_task(state.events.run(), name="proxy-events")
    heartbeat = asyncio.create_task(_heartbeats(state), name="proxy-heartbeat")
    state.bus.start()
    try:
        yield
    finally:
        await stop_task(heartbeat)
        if state.flow is not None:
            await state.flow.close()
        state.events.stopped()
        if not await state.events.flush(EVENT_FLUSH_TIMEOUT_S):
            log.warning("%d event(s) not published at shutdown (NATS unreachable?)", state.events.buffered)
        await stop_task(publisher)  # stop_task: a single cancel may be lost (services.tasks)
        await state.catalog.close()
        await state.bus.close()  # stops the watch, then drains NATS
        await engines.close()


def build_state(config: ProxyConfig) -> ProxyState:
    config.validate()
    router = Router(config.policy, config.seed, config.inflight_cap_per_capacity,
                    scorer_for(config.affinity, config.affinity_blocks), proxy_id=config.proxy_id, flow_limits=config.flow_control,
                    share=config.peer_interval_ms > 0, peer_stale_s=config.peer_stale_ms / 1000,
                    peer_stagger_s=config.peer_stagger_ms / 1000, peer_pick_s=config.peer_pick_ms / 1000,
                    latency=LatencyModel(), serve_late=config.slo_serve_late, kv_in_flight=config.kv_in_flight)
    events = EventPublisher(config.proxy_id, capacity=config.event_buffer, batch_max=config.event_batch_max,
                            flush_s=config.event_flush_ms / 1000)
    keys = ApiKeys.load(config.api_keys_file, config.key_max_inflight) if config.api_keys_file else None
    state = ProxyState(config=config, router=router, events=events, metrics=ProxyMetrics(config.proxy_id, keys),
                       bus=BusLink(config.nats_url, f"laswrr-proxy-{config.proxy_id}", router, events,
                                   auth=config.nats_auth, limits=StreamLimits(replicas=config.stream_replicas),
                                   peer_interval_s=config.peer_interval_ms / 1000, kv_view=config.tokenizer is not None,
                                   share_latency=config.share_latency),
                       keys=keys, upstream_auth=UpstreamAuth(config.forward_authorization, config.upstream_api_key),
                       slo=SloDefaults.parse(config.slo_defaults),
                       tokens=PromptTokenizer(config.tokenizer) if config.tokenizer is not None else None)
    if config.flow_control:
        state.flow = FlowGate(router, FlowConfig(bound=config.queue_bound, quantum=config.flow_quantum,
                                                 batch_every=config.flow_batch_every,
                                                 retry_after_cap_s=config.retry_after_cap_s,
                                                 interactive_reserve=config.interactive_reserve),
                              config.queue_ttl_ms / 1000, config.queue_ttl_max_ms / 1000, config.no_node_wait_ms / 1000)
        state.metrics.registry.register(FlowCollector(state.flow))
        state.bus.on_view = state.flow.wake  # a snapshot or a peer's message may free a slot for held requests
    state.idle.set()
    return state


ADMIN_GETS: dict[str, Handler] = {"/health": healthz, "/healthz": healthz, "/readiness": readiness, "/metrics": metrics}


class Dispatch:
    """The low-level server's handler (module header): POST ``posts`` -> ``forward_by_model``,
    GET and HEAD ``gets``, anything else ``not_found`` (405 with ``Allow`` on a known path)."""

    def __init__(self, state: ProxyState, posts: tuple[str, ...], gets: dict[str, Handler]) -> None:
        self.state = state
        self.routes: dict[tuple[str, str], Handler] = {}
        self.allowed: dict[str, tuple[str, ...]] = {}
        for path in posts:
            self.routes["POST", path] = forward_by_model
            self.allowed[path] = ("POST",)
        for path, handler in gets.items():
            self.routes["GET", path] = self.routes["HEAD", path] = handler
            self.allowed[path] = self.allowed.get(path, ()) + ("GET", "HEAD")

    def __call__(self, request: web.BaseRequest) -> Awaitable[web.StreamResponse]:
        # a plain function returning the handler's coroutine: one coroutine frame less per request
        handler = self.routes.get((request.method, request.rel_url.path_safe))  # the path aiohttp's router matched
        if handler is None:
            return not_found(request, self.allowed)
        return handler(request, self.state)


def proxy_dispatch(state: ProxyState, probes: bool = True) -> Dispatch:
    """The main listener's routes: every OpenAI POST route (plus ``--extra-routes``), ``GET
    /v1/models``, and the probes and /metrics unless ``--admin-port`` moved them."""
    extra = state.config.extra_routes
    posts = tuple(dict.fromkeys(OPENAI_POST_ROUTES + tuple(p for p in extra if p not in OPENAI_POST_ROUTES)))
    return Dispatch(state, posts, {"/v1/models": list_models, **(ADMIN_GETS if probes else {})})


def web_server(dispatch: Dispatch, max_body_bytes: int, **kwargs: Any) -> web.Server:
    """aiohttp's low-level server on ``dispatch``, requests allowed bodies up to ``max_body_bytes``;
    once the proxy stops, each response closes its connection (``RunningProxy.stop``)."""
    state = dispatch.state
    return web.Server(dispatch, request_factory=request_factory(max_body_bytes, lambda: state.stopping),
                      access_log=None, **kwargs)


# -- running -----------------------------------------------------------------------------------

@dataclass
class RunningProxy:
    state: ProxyState
    runner: web.ServerRunner
    site: web.TCPSite
    host: str
    port: int
    resources: contextlib.AbstractAsyncContextManager[None]
    admin_runner: web.ServerRunner | None = None
    admin_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    @property
    def _host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    async def stop(self) -> None:
        """Graceful stop: close the socket, let in-flight requests finish (grace), flush, stopped."""
        state = self.state
        state.stopping = True
        await self.site.stop()
        if state.flow is not None and (handed := state.flow.hand_back()):
            log.info("stopping: %d held request(s) answered 503 stopping (Retry-After: 1)", handed)
        server = self.runner.server
        if server is not None:
            # drain: requests still coming on open connections are served, each response saying
            # Connection: close; connections left idle through DRAIN_S are closed then (closing
            # one at once races a client sending on it: an error no retry covers)
            deadline = time.monotonic() + min(DRAIN_S, state.config.grace_s)
            while server.connections and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            server.pre_shutdown()  # idle keep-alive connections close; busy ones after their response
        if state.active:
            log.info("stopping: waiting up to %.1f s for %d request(s) in flight", state.config.grace_s, state.active)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(state.idle.wait(), state.config.grace_s)
        state.aborting = True
        if state.handlers:
            log.warning("grace period over: aborting %d request(s)", len(state.handlers))
            for task in list(state.handlers):
                task.cancel()
            await asyncio.gather(*state.handlers, return_exceptions=True)  # their finished events first
        await self.runner.cleanup()
        await self.resources.__aexit__(None, None, None)  # then: stopped event, flush, NATS drain
        if self.admin_runner is not None:
            await self.admin_runner.cleanup()


async def start(config: ProxyConfig, snapshot_wait_s: float = SNAPSHOT_WAIT_S) -> RunningProxy:
    state = build_state(config)
    resources = _resources(state)
    await resources.__aenter__()
    try:
        if config.reuse_port:
            await _first_snapshot(state, snapshot_wait_s)
        return await _listen(config, state, resources)
    except BaseException:
        await resources.__aexit__(None, None, None)
        raise


async def _first_snapshot(state: ProxyState, wait_s: float) -> None:
    """Until the proxy holds a routing snapshot, for at most ``wait_s`` (module header, "Lifecycle")."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(state.bus.installed.wait(), wait_s)
    if not state.router.table.names():
        log.warning("proxy %s: no routing snapshot after %g s; listening anyway (503 no_snapshot until one comes)",
                    state.config.proxy_id, wait_s)


async def _listen(config: ProxyConfig, state: ProxyState,
                  resources: contextlib.AbstractAsyncContextManager[None]) -> RunningProxy:
    server = web_server(proxy_dispatch(state, probes=config.admin_port is None), config.max_body_bytes,
                        handler_cancellation=True, keepalive_timeout=config.idle_timeout_s)
    runner = web.ServerRunner(server, shutdown_timeout=1.0)
    server_log = logging.getLogger("aiohttp.server")
    if _QUIET not in server_log.filters:
        server_log.addFilter(_QUIET)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_port=config.reuse_port or None)
    await site.start()
    port = _bound_port(runner, config.port)
    log.info("proxy %s listening on %s:%d (policy %s%s)", config.proxy_id, config.host, port, config.policy,
             ", API keys required" if state.keys is not None else "")
    proxy = RunningProxy(state=state, runner=runner, site=site, host=config.host, port=port, resources=resources)
    if config.admin_port is not None:
        admin = web_server(Dispatch(state, (), ADMIN_GETS), 1 << 20)
        proxy.admin_runner = web.ServerRunner(admin, shutdown_timeout=1.0)
        await proxy.admin_runner.setup()
        admin_site = web.TCPSite(proxy.admin_runner, config.host, config.admin_port)
        await admin_site.start()
        proxy.admin_port = _bound_port(proxy.admin_runner, config.admin_port)
        log.info("proxy %s: /metrics and probes on %s:%d", config.proxy_id, config.host, proxy.admin_port)
    return proxy


def _bound_port(runner: web.ServerRunner, fallback: int) -> int:
    """The port the runner's one site listens on (what port 0 chose): ``BaseRunner.addresses``."""
    addresses = runner.addresses
    return int(addresses[0][1]) if addresses else fallback
