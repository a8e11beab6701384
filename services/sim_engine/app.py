"""HTTP face of the simulated engine (aiohttp): OpenAI API, /metrics, /health, admin faults.

Models a vLLM-Ascend OpenAI server in front of the continuous-batching physics:

* ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses`` (SSE when
  ``stream``), ``POST /v1/embeddings`` (``embeddings.py``), ``GET /v1/models``;
* ``GET /health`` (200, or 503 when fail=http500 or chip health is Alarm/Critical);
* ``GET /metrics`` in vLLM format; ``GET /sim/state`` (load + npu-smi readings, JSON);
* ``GET /sim/npu-smi``: this engine's NPU as ``npu-smi info`` prints it (text/plain, built by
  ``npu_smi.render``), so a collector can sample it with ``curl`` instead of a Python process;
* ``GET|POST /admin``: capacity, slowdown, fail (none|refuse|http500|cut_stream|stall_stream),
  health, cut_after. ``refuse`` is a dead engine process: it resets the connections of the
  requests in flight and drops every new connection except /admin, /sim/state and /sim/npu-smi
  unanswered (the NPU is still there: its HBM falls to the floor). ``cut_stream`` resets each
  stream's connection after ``cut_after`` tokens (a non-streamed request's before its answer);
  ``stall_stream`` stops sending each stream after ``cut_after`` tokens and holds the
  connection open (a hung engine; a test may then kill the process).

Every response carries ``x-sim-node``. A client that goes away cancels its request (the
server runs with aiohttp ``handler_cancellation``; see ``start_server``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec
from aiohttp import web

from laswrr.services.sim_engine import npu_smi
from laswrr.services.sim_engine.config import FAIL_MODES, HEALTH_STATES, FaultState, SimConfig
from laswrr.services.sim_engine.driver import EngineDriver, RequestHandle
from laswrr.services.sim_engine.embeddings import embedding_response, parse_embedding_request
from laswrr.services.sim_engine.metrics import CONTENT_TYPE, SimMetrics
from laswrr.services.sim_engine.openai_api import (
    ApiError,
    CompletionRequest,
    Kind,
    filler_tokens,
    full_response,
    parse_request,
    response_event,
    response_object,
    stream_chunk,
    text_delta,
    usage_chunk,
)
from laswrr.services.sim_engine.physics import EngineSim, TokenEvent

NODE_HEADER = "x-sim-node"
REFUSE_EXEMPT_PATHS = frozenset({"/admin", "/sim/state", "/sim/npu-smi"})


@dataclass(slots=True)
class NodeName:
    """The x-sim-node value; without --node-id it is <chip>-<bound port>, known after bind."""

    value: str


CONFIG_KEY = web.AppKey("sim_config", SimConfig)
FAULTS_KEY = web.AppKey("sim_faults", FaultState)
METRICS_KEY = web.AppKey("sim_metrics", SimMetrics)
DRIVER_KEY = web.AppKey("sim_driver", EngineDriver)
STARTED_KEY = web.AppKey("sim_started", float)
NODE_KEY = web.AppKey("sim_node", NodeName)
INFLIGHT_KEY = web.AppKey("sim_inflight", set[asyncio.BaseTransport])  # of the completions being served

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# --------------------------------------------------------------------------- helpers


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json")


def _error(err: ApiError) -> web.Response:
    return _json(err.body(), err.status)


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def _node_id(app: web.Application) -> str:
    return app[NODE_KEY].value


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"invalid JSON body: {exc}", code="invalid_json") from None


def _drain(queue: asyncio.Queue[TokenEvent], first: TokenEvent) -> list[TokenEvent]:
    """The event just received plus whatever else is already buffered (slow client)."""
    events = [first]
    while not queue.empty():
        events.append(queue.get_nowait())
    return events


def _cut_now(request: web.Request, tokens_sent: int) -> bool:
    faults = request.app[FAULTS_KEY]
    return faults.fail in ("cut_stream", "stall_stream") and tokens_sent >= faults.cut_after


def _abort_connection(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.close()


# --------------------------------------------------------------------------- middleware


@web.middleware
async def refuse_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """fail=refuse: drop the connection without an answer (admin stays reachable)."""
    if request.app[FAULTS_KEY].fail == "refuse" and request.path not in REFUSE_EXEMPT_PATHS:
        if request.transport is not None:
            request.transport.abort()
        raise asyncio.CancelledError  # nothing is written; aiohttp just drops the request
    return await handler(request)


async def _add_node_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[NODE_HEADER] = _node_id(request.app)


# --------------------------------------------------------------------------- completions


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completions(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completions(request, "completion")


async def responses(request: web.Request) -> web.StreamResponse:
    return await _completions(request, "response")


RID_PREFIX: dict[Kind, str] = {"chat": "chatcmpl-", "completion": "cmpl-", "response": "resp_"}
HTTP500 = ApiError(500, "simulated engine failure (fail=http500)", "InternalServerError", "sim_http500")


async def embeddings(request: web.Request) -> web.StreamResponse:
    """Each request is one prefill of its inputs plus a step: it takes a slot like a completion."""
    app = request.app
    if app[FAULTS_KEY].fail == "http500":
        return _error(HTTP500)
    try:
        ereq = parse_embedding_request(await _read_json(request), app[CONFIG_KEY].model_name)
        handle = app[DRIVER_KEY].submit(ereq.prompt_tokens, 1, "stop")
    except ApiError as err:
        return _error(err)
    except ValueError as exc:  # cannot fit in the KV cache
        return _error(ApiError(400, str(exc), code="context_length_exceeded"))
    try:
        await handle.queue.get()
    finally:
        if not handle.req.done:
            app[DRIVER_KEY].cancel(handle)
    return _json(embedding_response(ereq, app[CONFIG_KEY].seed))


async def _completions(request: web.Request, kind: Kind) -> web.StreamResponse:
    app = request.app
    if app[FAULTS_KEY].fail == "http500":
        return _error(HTTP500)
    try:
        creq = parse_request(await _read_json(request), kind, app[CONFIG_KEY].model_name)
        handle = app[DRIVER_KEY].submit(creq.prompt_tokens, creq.output_tokens, creq.finish_reason,
                                        creq.prompt_text)
    except ApiError as err:
        return _error(err)
    except ValueError as exc:  # cannot fit in the KV cache
        return _error(ApiError(400, str(exc), code="context_length_exceeded"))
    words = filler_tokens(app[CONFIG_KEY].seed, creq.prompt_text, creq.output_tokens)
    rid = RID_PREFIX[kind] + uuid.uuid4().hex
    transport = request.transport
    if transport is not None:
        app[INFLIGHT_KEY].add(transport)
    try:
        if creq.stream:
            stream = _stream_response if kind == "response" else _stream
            return await stream(request, creq, handle, words, rid)
        return await _unary(request, creq, handle, words, rid)
    finally:
        app[INFLIGHT_KEY].discard(transport)  # type: ignore[arg-type]
        if not handle.req.done:  # client gone, cut, or server stopping
            app[DRIVER_KEY].cancel(handle)


async def _unary(request: web.Request, creq: CompletionRequest, handle: RequestHandle,
                 words: list[str], rid: str) -> web.StreamResponse:
    produced = 0
    while produced < creq.output_tokens:
        await handle.queue.get()
        produced += 1
        if _cut_now(request, produced):
            if request.app[FAULTS_KEY].fail == "stall_stream":
                await asyncio.Event().wait()  # hung: until the client leaves or the process dies
            _abort_connection(request)
            return web.Response(status=500)  # never reaches the client
    shape = response_object if creq.kind == "response" else partial(full_response, creq.kind)
    return _json(shape(rid, int(time.time()), creq.model, "".join(words), creq.finish_reason, creq.prompt_tokens,
                       creq.output_tokens))


async def _stream(request: web.Request, creq: CompletionRequest, handle: RequestHandle,
                  words: list[str], rid: str) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    created, sent, finished = int(time.time()), 0, False
    while not finished:
        batch = _drain(handle.queue, await handle.queue.get())
        out = bytearray()
        for event in batch:
            out += _sse(stream_chunk(creq.kind, rid, created, creq.model, words[event.index], first=event.index == 0))
            sent += 1
            finished = event.finished
            if _cut_now(request, sent):
                return await _cut_stream(request, resp, out)
        await resp.write(bytes(out))
    tail = _sse(stream_chunk(creq.kind, rid, created, creq.model, "" if creq.kind == "completion" else None,
                             finish=creq.finish_reason))
    if creq.include_usage:
        tail += _sse(usage_chunk(creq.kind, rid, created, creq.model, creq.prompt_tokens, sent))
    await resp.write(tail + b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _cut_stream(request: web.Request, resp: web.StreamResponse, out: bytearray) -> web.StreamResponse:
    """A stream cut by a fault: what was produced is sent, then the engine hangs (``stall_stream``:
    until the client leaves or the process dies) or breaks the connection."""
    await resp.write(bytes(out))
    if request.app[FAULTS_KEY].fail == "stall_stream":
        await asyncio.Event().wait()
    _abort_connection(request)
    return resp


async def _stream_response(request: web.Request, creq: CompletionRequest, handle: RequestHandle,
                           words: list[str], rid: str) -> web.StreamResponse:
    """``/v1/responses`` streamed: created, one text delta per token, completed (no ``[DONE]``)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    created, sent = int(time.time()), 0

    def event(obj: dict[str, Any]) -> bytes:
        return f"event: {obj['type']}\n".encode() + _sse(obj)

    start = response_object(rid, created, creq.model, None, creq.finish_reason, creq.prompt_tokens, 0)
    await resp.write(event(response_event("response.created", 0, response=start)))
    while sent < creq.output_tokens:
        batch = _drain(handle.queue, await handle.queue.get())
        out = bytearray()
        for item in batch:
            sent += 1
            out += event(text_delta(rid, sent, words[item.index]))
            if _cut_now(request, sent):
                return await _cut_stream(request, resp, out)
        await resp.write(bytes(out))
    done = response_object(rid, created, creq.model, "".join(words[:sent]), creq.finish_reason, creq.prompt_tokens,
                           sent)
    await resp.write(event(response_event("response.completed", sent + 1, response=done)))
    await resp.write_eof()
    return resp


# --------------------------------------------------------------------------- other routes


async def list_models(request: web.Request) -> web.Response:
    config = request.app[CONFIG_KEY]
    model = {"id": config.model_name, "object": "model", "created": int(request.app[STARTED_KEY]),
             "owned_by": "laswrr-sim", "root": config.model_name, "parent": None}
    return _json({"object": "list", "data": [model]})


async def health(request: web.Request) -> web.Response:
    faults = request.app[FAULTS_KEY]
    if faults.endpoint_healthy:
        return web.Response(text="")
    return _json({"status": "unhealthy", "fail": faults.fail, "health": faults.health}, 503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS_KEY].render(request.app[DRIVER_KEY].snapshot())
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def admin_state(app: web.Application) -> dict[str, Any]:
    config, sim = app[CONFIG_KEY], app[DRIVER_KEY].sim
    return {"node_id": _node_id(app), "chip": config.profile.chip, "model": config.model_name,
            "capacity": sim.capacity, "slowdown": sim.slowdown, "speed": config.speed,
            **app[FAULTS_KEY].as_dict()}


async def get_admin(request: web.Request) -> web.Response:
    return _json(admin_state(request.app))


def _validate_admin(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict) or not body:
        raise ApiError(400, "admin body must be a non-empty JSON object", code="bad_request")
    checks: dict[str, Callable[[Any], bool]] = {
        "capacity": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        "slowdown": lambda v: isinstance(v, int | float) and not isinstance(v, bool) and v > 0,
        "fail": lambda v: v in FAIL_MODES,
        "health": lambda v: v in HEALTH_STATES,
        "cut_after": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
    }
    hints = {"capacity": "an integer >= 0", "slowdown": "a number > 0", "fail": " | ".join(FAIL_MODES),
             "health": " | ".join(HEALTH_STATES), "cut_after": "an integer >= 1"}
    for key, value in body.items():
        if key not in checks:
            raise ApiError(400, f"unknown admin field {key!r}; known: {', '.join(checks)}", code="invalid_value", param=key)
        if not checks[key](value):
            raise ApiError(400, f"admin field {key!r} must be {hints[key]}, got {value!r}", code="invalid_value", param=key)
    return body


async def post_admin(request: web.Request) -> web.Response:
    app = request.app
    try:
        changes = _validate_admin(await _read_json(request))
    except ApiError as err:
        return _error(err)
    driver, faults = app[DRIVER_KEY], app[FAULTS_KEY]
    if "capacity" in changes:
        driver.sim.set_capacity(changes["capacity"])
    if "slowdown" in changes:
        driver.sim.set_slowdown(float(changes["slowdown"]))
    for key in ("fail", "health", "cut_after"):
        if key in changes:
            setattr(faults, key, changes[key])
    if changes.get("fail") == "refuse":  # the engine process died: its connections reset
        for transport in list(app[INFLIGHT_KEY]):
            transport.abort()  # type: ignore[attr-defined]
    driver.kick()
    return _json(admin_state(app))


def sim_state(app: web.Application) -> dict[str, Any]:
    config, faults, driver = app[CONFIG_KEY], app[FAULTS_KEY], app[DRIVER_KEY]
    profile, snap = config.profile, driver.snapshot()
    engine_up = faults.fail != "refuse"
    npu = npu_smi.readings(profile, snap.running, snap.capacity, engine_up)
    return {
        "node_id": _node_id(app), "chip": profile.chip, "model": config.model_name,
        "running": snap.running, "waiting": snap.waiting, "capacity": snap.capacity,
        "kv_usage": snap.kv_usage, "kv_tokens_used": snap.kv_tokens_used, "kv_tokens_total": snap.kv_tokens_total,
        "health": faults.health, "fail": faults.fail, "engine_up": engine_up, "slowdown": driver.sim.slowdown,
        "tokens_generated": driver.sim.tokens_generated, "requests_finished": driver.sim.requests_finished,
        "prefix_cache_queries": snap.prefix_cache_queries, "prefix_cache_hits": snap.prefix_cache_hits,
        "npu": {"name": profile.npu_name, "chips": profile.chips_per_npu, "aicore_pct": npu.aicore_pct,
                "hbm_used_mb": npu.hbm_used_mb, "hbm_total_mb": npu.hbm_total_mb,
                "power_w": npu.power_w, "temp_c": npu.temp_c},
    }


async def get_sim_state(request: web.Request) -> web.Response:
    return _json(sim_state(request.app))


async def get_sim_npu_smi(request: web.Request) -> web.Response:
    app = request.app
    return web.Response(text=npu_smi.render(sim_state(app), app[CONFIG_KEY].npu_id), content_type="text/plain")


# --------------------------------------------------------------------------- app


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG_KEY]
    sim = EngineSim(config.profile, config.capacity, speed=config.speed, kv_tokens=config.kv_tokens)
    driver = EngineDriver(sim, app[METRICS_KEY])
    app[DRIVER_KEY] = driver
    await driver.start()
    yield
    await driver.stop()


def init_app(config: SimConfig) -> web.Application:
    """The aiohttp application for one simulated engine (ValueError on a bad config).

    Run it with ``start_server`` (or an AppRunner with ``handler_cancellation=True``): without
    handler cancellation a client that leaves while its request waits is only noticed at the
    first write, so its slot is freed late.
    """
    config.validate()
    app = web.Application(middlewares=[refuse_middleware])
    app[CONFIG_KEY] = config
    app[FAULTS_KEY] = FaultState()
    app[METRICS_KEY] = SimMetrics(config.model_name)
    app[STARTED_KEY] = time.time()
    app[NODE_KEY] = NodeName(config.node_id or f"{config.profile.chip}-{config.port}")
    app[INFLIGHT_KEY] = set()
    app.cleanup_ctx.append(_engine_ctx)
    app.on_response_prepare.append(_add_node_header)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin", get_admin)
    app.router.add_post("/admin", post_admin)
    app.router.add_get("/sim/state", get_sim_state)
    app.router.add_get("/sim/npu-smi", get_sim_npu_smi)
    return app


@dataclass(slots=True)
class RunningServer:
    runner: web.AppRunner
    url: str

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_server(config: SimConfig) -> RunningServer:
    """Start one engine on config.host:config.port (0 = any free port); returns its URL."""
    app = init_app(config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    host, port = runner.addresses[0][:2]
    if config.node_id is None:  # name the node after the bound port
        app[NODE_KEY].value = f"{config.profile.chip}-{port}"
    host = f"[{host}]" if ":" in host else host
    return RunningServer(runner, f"http://{host}:{port}")

