"""The proxy's HTTP face: OpenAI-compatible routes, health, metrics, graceful stop.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (forwarded, SSE or not),
``GET /v1/models``, ``GET /healthz``, ``GET /metrics`` (404 for any other path, 405 for another
method). Handlers hold no policy: they validate input (400 invalid JSON, 413 body over
``max_body_bytes`` (refused by the server before the body is read), 404 unknown model, 503 no
snapshot yet or no routable node, all OpenAI-style ``{"error": {message, type, code}}``), pick
the pool, ask the router for an admission and hand over to ``upstream.Forwarder``. The HTTP/1.1
plumbing is ``services.proxy.server``.

Model -> pool: a pool with that exact name; else the pool whose engines list that model id on
their ``/v1/models``; else the pool ``default`` if it exists; else 404.

Lifecycle. ``start`` opens the resources (the upstream pool and an aiohttp session for
``/v1/models`` and non-http engines, the NATS link (background connect + LB_WEIGHTS watch), the
event publisher and the heartbeat) and then listens. ``RunningProxy.stop`` stops accepting and
closes idle connections first, lets in-flight requests finish within ``grace_s`` (requests still
running then are cancelled: ``router_aborted``), then publishes ``lb.proxy.stopped.<proxy>``,
flushes the event buffer, drains NATS and closes what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from itertools import count

import aiohttp
import msgspec

from services.proxy.bus import BusLink
from services.proxy.config import ProxyConfig
from services.proxy.events import EventPublisher
from services.proxy.metrics import CONTENT_TYPE, ProxyMetrics
from services.proxy.models import ModelCatalog
from services.proxy.routing import Router
from services.proxy.server import HttpRequest, HttpServer, Responder
from services.proxy.tasks import stop_task
from services.proxy.upstream import Exchange, Forwarder, error_response, forward_headers
from services.proxy.upstream_http import UpstreamPool

log = logging.getLogger("laswrr.proxy")

EVENT_FLUSH_TIMEOUT_S = 5.0


class RequestPeek(msgspec.Struct):
    """The only fields the proxy reads from a request body; the body itself is forwarded as is."""

    model: str | None = None


_PEEK = msgspec.json.Decoder(RequestPeek)


@dataclass
class ProxyState:
    config: ProxyConfig
    router: Router
    events: EventPublisher
    metrics: ProxyMetrics
    bus: BusLink
    forwarder: Forwarder | None = None
    catalog: ModelCatalog | None = None
    stopping: bool = False
    aborting: bool = False
    active: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    handlers: set[asyncio.Task[object]] = field(default_factory=set)
    ids: count[int] = field(default_factory=lambda: count(1))
    boot: str = field(default_factory=lambda: format(time.time_ns() // 1000 % (1 << 40), "x"))

    def next_request_id(self) -> str:
        return f"{self.config.proxy_id}-{self.boot}-{next(self.ids)}"


Route = Callable[[ProxyState, HttpRequest, Responder], Awaitable[None]]


# -- handlers ----------------------------------------------------------------------------------

async def completions(state: ProxyState, request: HttpRequest, responder: Responder) -> None:
    if state.stopping:
        state.metrics.rejected.labels(reason="stopping").inc()
        error_response(503, "proxy is shutting down", "service_unavailable", "shutting_down",
                       headers=[("Retry-After", "1"), ("Connection", "close")]).send(responder)
        return
    state.active += 1
    state.idle.clear()
    task = responder.conn.task  # the task running this request (cancelled at the end of the grace period)
    if task is not None:
        state.handlers.add(task)
    try:
        await _completions(state, request, responder)
    finally:
        state.handlers.discard(task)  # type: ignore[arg-type]
        state.active -= 1
        if state.active == 0:
            state.idle.set()


async def _completions(state: ProxyState, request: HttpRequest, responder: Responder) -> None:
    body = request.body
    try:
        peek = _PEEK.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        state.metrics.rejected.labels(reason="bad_json").inc()
        error_response(400, f"invalid JSON body: {exc}", "invalid_request_error", "invalid_json").send(responder)
        return
    router = state.router
    if not router.pools:  # cold start with NATS not (yet) reachable: nothing to route on
        state.metrics.rejected.labels(reason="no_snapshot").inc()
        error_response(503, "no routing snapshot yet (is the scheduler running?)", "service_unavailable",
                       "no_snapshot", headers=[("Retry-After", "1")]).send(responder)
        return
    hint = None
    if peek.model is not None and peek.model not in router.pools and state.catalog is not None:
        hint = await state.catalog.pool_hint()
    pool = router.resolve_pool(peek.model, hint)
    if pool is None:
        state.metrics.rejected.labels(reason="unknown_model").inc()
        _unknown_model(peek.model, router, responder)
        return
    admission = router.admit(pool)
    if admission is None:
        state.metrics.rejected.labels(reason="no_routable_node").inc()
        error_response(503, f"no routable node in pool {pool!r}", "service_unavailable", "no_routable_node",
                       headers=[("Retry-After", "1")]).send(responder)
        return
    request_id = state.next_request_id()
    exchange = Exchange(request_id=request_id, pool=pool, path_qs=request.target, method=request.method, body=body,
                        headers=forward_headers(request.raw_headers, request_id), arrived=request.arrived)
    assert state.forwarder is not None
    await state.forwarder.forward(responder, exchange, admission)


def too_large(state: ProxyState, responder: Responder) -> None:
    """Called by the server for a body over the limit (the connection closes afterwards)."""
    limit = state.config.max_body_bytes
    state.metrics.rejected.labels(reason="body_too_large").inc()
    error_response(413, f"request body exceeds the {limit}-byte limit", "invalid_request_error",
                   "request_too_large").send(responder)


def _unknown_model(model: str | None, router: Router, responder: Responder) -> None:
    pools = ", ".join(sorted(router.pools)) or "none yet"
    message = f"The model `{model}` does not exist (pools: {pools})" if model else \
        f"no model given and no pool 'default' (pools: {pools})"
    responder.json(404, {"error": {"message": message, "type": "invalid_request_error", "param": "model",
                                   "code": "model_not_found"}})


async def list_models(state: ProxyState, request: HttpRequest, responder: Responder) -> None:
    assert state.catalog is not None
    responder.json(200, await state.catalog.listing())


async def healthz(state: ProxyState, request: HttpRequest, responder: Responder) -> None:
    responder.json(503 if state.stopping else 200, health_report(state))


def health_report(state: ProxyState) -> dict[str, object]:
    now_ns, now = time.time_ns(), time.monotonic()
    pools = {}
    stale = not state.bus.connected
    for name, route in sorted(state.router.pools.items()):
        age = max(0.0, (now_ns - route.snapshot.ts_ns) / 1e9)
        stale = stale or age > state.config.stale_after_s
        pools[name] = {"as_of_seq": route.snapshot.as_of_seq, "tick": route.snapshot.tick, "age_s": round(age, 3),
                       "received_s_ago": round(now - route.received_at, 3), "panic": route.snapshot.panic,
                       "nodes": len(route.snapshot.nodes), "routable": sorted(route.targets)}
    status = "stopping" if state.stopping else "no_snapshot" if not pools else "stale" if stale else "ok"
    return {"status": status, "proxy": state.config.proxy_id, "policy": state.config.policy,
            "nats_connected": state.bus.connected, "inflight": state.router.total_inflight,
            "events_buffered": state.events.buffered, "events_dropped": state.events.dropped, "pools": pools}


async def metrics(state: ProxyState, request: HttpRequest, responder: Responder) -> None:
    state.metrics.refresh(state.router, state.events, state.bus.connected)
    responder.send(200, state.metrics.render(), [("Content-Type", CONTENT_TYPE)])


ROUTES: dict[str, dict[str, Route]] = {
    "/v1/chat/completions": {"POST": completions},
    "/v1/completions": {"POST": completions},
    "/v1/models": {"GET": list_models},
    "/healthz": {"GET": healthz},
    "/metrics": {"GET": metrics},
}


def dispatcher(state: ProxyState) -> Callable[[HttpRequest, Responder], Awaitable[None]]:
    async def dispatch(request: HttpRequest, responder: Responder) -> None:
        methods = ROUTES.get(request.path)
        if methods is None:
            error_response(404, f"no route {request.path}", "invalid_request_error", "not_found").send(responder)
            return
        route = methods.get("GET" if request.method == "HEAD" else request.method)  # HEAD: GET without the body
        if route is None:
            allowed = ", ".join(methods)
            error_response(405, f"{request.method} not allowed on {request.path} (use {allowed})",
                           "invalid_request_error", "method_not_allowed", headers=[("Allow", allowed)]).send(responder)
            return
        await route(state, request, responder)
    return dispatch


# -- resources ---------------------------------------------------------------------------------

async def _heartbeats(state: ProxyState) -> None:
    while True:
        await asyncio.sleep(state.config.heartbeat_s)
        state.events.heartbeat(state.router.total_inflight)


@dataclass
class Resources:
    """What ``start`` opened besides the listening socket, closed by ``RunningProxy.stop``."""

    session: aiohttp.ClientSession
    pool: UpstreamPool
    publisher: asyncio.Task[None]
    heartbeat: asyncio.Task[None]


def _open(state: ProxyState) -> Resources:
    config = state.config
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30)
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                    skip_auto_headers=("Accept-Encoding",))
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s,
                                    sock_read=config.upstream_timeout_s)
    pool = UpstreamPool(config.connect_timeout_s, config.upstream_timeout_s)
    state.forwarder = Forwarder(session, state.router, state.events, state.metrics, config.max_retries,
                                timeout, aborting=lambda: state.aborting, pool=pool)
    state.catalog = ModelCatalog(session, state.router, ttl_s=config.models_ttl_s)
    publisher = asyncio.create_task(state.events.run(), name="proxy-events")
    heartbeat = asyncio.create_task(_heartbeats(state), name="proxy-heartbeat")
    state.bus.start()
    return Resources(session=session, pool=pool, publisher=publisher, heartbeat=heartbeat)


async def _close(state: ProxyState, res: Resources) -> None:
    await stop_task(res.heartbeat)
    state.events.stopped()
    if not await state.events.flush(EVENT_FLUSH_TIMEOUT_S):
        log.warning("%d event(s) not published at shutdown (NATS unreachable?)", state.events.buffered)
    await stop_task(res.publisher)  # stop_task: a single cancel may be lost (services.proxy.tasks)
    if state.catalog is not None:
        await state.catalog.close()
    await state.bus.close()  # stops the watch, then drains NATS
    res.pool.close()
    await res.session.close()


def new_state(config: ProxyConfig) -> ProxyState:
    config.validate()
    router = Router(config.policy, config.seed, config.inflight_cap_per_capacity)
    events = EventPublisher(config.proxy_id, capacity=config.event_buffer)
    state = ProxyState(config=config, router=router, events=events, metrics=ProxyMetrics(config.proxy_id),
                       bus=BusLink(config.nats_url, f"laswrr-proxy-{config.proxy_id}", router, events))
    state.idle.set()
    return state


# -- running -----------------------------------------------------------------------------------

@dataclass
class RunningProxy:
    state: ProxyState
    server: HttpServer
    resources: Resources
    host: str
    port: int

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    async def stop(self) -> None:
        """Graceful stop: close the socket, let in-flight requests finish (grace), flush, stopped."""
        state = self.state
        state.stopping = True
        self.server.shutdown()  # no new connections; idle keep-alive ones close, busy ones after their answer
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
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.server.idle.wait(), 1.0)  # /healthz and the like
        await _close(state, self.resources)  # then: stopped event, flush, NATS drain
        self.server.abort()


async def start(config: ProxyConfig) -> RunningProxy:
    state = new_state(config)
    server = HttpServer(dispatcher(state), lambda responder: too_large(state, responder), config.max_body_bytes)
    port = await server.listen(config.host, config.port, reuse_port=config.reuse_port)
    resources = _open(state)  # no await since listen: no request can arrive before the forwarder exists
    log.info("proxy %s listening on %s:%d (policy %s)", config.proxy_id, config.host, port, config.policy)
    return RunningProxy(state=state, server=server, resources=resources, host=config.host, port=port)
