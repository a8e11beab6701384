"""HTTP face of the simulated engine (aiohttp): OpenAI API, /metrics, /health, admin faults.

Models a vLLM-Ascend OpenAI server in front of the continuous-batching physics:

* ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses`` (SSE when
  ``stream``), ``POST /v1/embeddings`` (``embeddings.py``), ``GET /v1/models``;
* ``GET /health`` (200, or 503 when fail=http500 or chip health is Alarm/Critical);
* ``GET /metrics`` in vLLM format; ``GET /sim/state`` (load + npu-smi readings, JSON);
* ``GET /sim/npu-smi``: this engine's NPU as ``npu-smi info`` prints it (text/plain, built by
  ``npu_smi.render``), so a collector can sample it with ``curl`` instead of a Python process;
* ``GET /sim/npu-exporter``: its chips as MindCluster's npu-exporter exports them, a cache
  refreshed every ``--exporter-update-s``; with ``--flavour mindie`` also MindIE's
  ``GET /v1/status``, ``/v2/status`` and ``/metrics-json``, and MindIE's /metrics names
  (``mindie.py``);
* ``GET|POST /admin``: capacity, slowdown, fail (none|refuse|http500|cut_stream|stall_stream),
  health, cut_after, fault_code (a code only its simulated npu-exporter reports). ``refuse`` is a dead engine process: it resets the connections of the
  requests in flight and drops every new connection except /admin, /sim/state and /sim/npu-smi
  unanswered (the NPU is still there: its HBM falls to the floor). ``cut_stream`` resets each
  stream's connection after ``cut_after`` tokens (a non-streamed request's before its answer);
  ``stall_stream`` stops sending each stream after ``cut_after`` tokens and holds the
  connection open (a hung engine; a test may then kill the process).

With ``--pd-role prefill`` or ``decode`` the engine plays one side of vLLM's prefill/decode
protocol (``_pd_leg``): a prefill instance asked ``kv_transfer_params.do_remote_decode`` prefills,
answers its one token with ``kv_transfer_params`` naming its KV (``do_remote_prefill``,
``remote_engine_id``, ``remote_block_ids``, ...); a decode instance answers 400 to a request
without such params, else "transfers" the prompt's KV (``KV_TRANSFER_TOKENS_PER_S``, times
``--speed``) and decodes without a prefill (its KV counted, its first step computing none).

With ``--pd-protocol sglang`` it plays SGLang's side instead (``_sglang_prefill``,
``_bootstrap``): both legs carry ``bootstrap_host``/``bootstrap_port``/``bootstrap_room``. A prefill
instance (``--bootstrap-port``: a second listening port, its bootstrap server) opens the room,
prefills, produces its one token, then holds its answer until a decode instance has taken the
room's KV (``GET /sim/bootstrap/<room>`` on the bootstrap port), at most
``--bootstrap-timeout-s``; a decode instance asks the prefill's bootstrap server for the room
(waiting for it up to the same timeout), "transfers" the KV and decodes. Either side fails with
500 when its counterpart cannot come (no room within the timeout, the prefill's request gone,
the prefill instance unreachable); a request without the bootstrap fields is refused with 400.

Every response carries ``x-sim-node``. A client that goes away cancels its request (the
server runs with aiohttp ``handler_cancellation``; see ``start_server``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from laswrr.services.proxy.tokens import PromptTokenizer
from laswrr.services.sim_engine import mindie, npu_smi
from laswrr.schemas.words import NodeRole, NpuHealth, PdProtocol
from laswrr.services.sim_engine.config import (
    FAIL_MODES,
    HEALTH_STATES,
    KV_TRANSFER_TOKENS_PER_S,
    FaultState,
    SimConfig,
)
from laswrr.services.sim_engine.driver import EngineDriver, RequestHandle
from laswrr.services.sim_engine.embeddings import embedding_response, parse_embedding_request
from laswrr.services.sim_engine.kv_publisher import KvEventPublisher
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
REFUSE_EXEMPT_PATHS = frozenset({"/admin", "/sim/state", "/sim/npu-smi", "/sim/npu-exporter"})


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
EXPORTER_KEY = web.AppKey("sim_exporter", mindie.ExporterCache)
TOKENIZER_KEY = web.AppKey("sim_tokenizer", PromptTokenizer | None)  # type: ignore[arg-type]


@dataclass(slots=True)
class Room:
    """One sglang bootstrap room: opened by its prefill request (or first asked for by a decode)."""

    prompt_tokens: int = 0
    owned: bool = False  # a prefill request holds it
    failed: str | None = None  # why no KV will come
    waiters: int = 0  # decode instances waiting for it
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # the prefill is done (or failed)
    taken: asyncio.Event = field(default_factory=asyncio.Event)  # a decode took the KV


ENDED_ROOMS = 4096  # rooms whose prefill request ended, remembered for a late decode's question
ROOMS_KEY = web.AppKey("sim_rooms", dict[int, Room])
ENDED_KEY = web.AppKey("sim_rooms_ended", OrderedDict[int, str])
HTTP_KEY = web.AppKey("sim_http", aiohttp.ClientSession)  # a decode instance's client of its prefills' bootstrap

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
    config = app[CONFIG_KEY]
    room: tuple[int, Room] | None = None
    try:
        try:
            body = await _read_json(request)
            creq = parse_request(body, kind, config.model_name)
            token_ids = _model_tokens(app, body, kind)
            if token_ids is not None and "prompt_tokens" not in (body.get("sim") or {}):  # sim.prompt_tokens wins
                creq = dataclasses.replace(creq, prompt_tokens=len(token_ids))
            if config.pd_protocol == PdProtocol.SGLANG and config.pd_role == NodeRole.PREFILL:
                room = _open_room(app, body, creq)
                creq = dataclasses.replace(creq, output_tokens=1, finish_reason="length")
                received, kv_params = False, None
            elif config.pd_protocol == PdProtocol.SGLANG and config.pd_role == NodeRole.DECODE:
                received, kv_params = await _bootstrap(app, body), None
            else:
                received, kv_params = _pd_leg(config, body, creq, _node_id(app), request.url.host, request.url.port)
            if received:  # the decode instance pulls the prompt's KV from the prefill instance first
                await asyncio.sleep(creq.prompt_tokens / KV_TRANSFER_TOKENS_PER_S / config.speed)
            handle = app[DRIVER_KEY].submit(creq.prompt_tokens, creq.output_tokens, creq.finish_reason,
                                            creq.prompt_text, kv_received=received, token_ids=token_ids)
        except ApiError as err:
            return _error(err)
        except ValueError as exc:  # cannot fit in the KV cache
            return _error(ApiError(400, str(exc), code="context_length_exceeded"))
        if room is not None:
            return await _serve(request, app, handle, _sglang_prefill(app, creq, handle, room))
        return await _completion_answer(request, app, kind, creq, handle, kv_params)
    finally:
        if room is not None:
            _end_room(app, *room)


def _model_tokens(app: web.Application, body: dict[str, Any], kind: Kind) -> list[int] | None:
    """With ``--tokenizer``: a chat or completion prompt in the model's tokens, as a vLLM engine (and
    the proxy's exact view, ``services/proxy/tokens.py``) computes them; None without one, or when
    the prompt does not render (it is then counted and cached in the simulator's own tokens)."""
    tokenizer = app[TOKENIZER_KEY]
    if tokenizer is None or kind == "response":
        return None
    return tokenizer.encode(body.get("messages"), body.get("prompt")) or None


async def _serve(request: web.Request, app: web.Application, handle: RequestHandle,
                 answer: Awaitable[web.StreamResponse]) -> web.StreamResponse:
    transport = request.transport
    if transport is not None:
        app[INFLIGHT_KEY].add(transport)
    try:
        return await answer
    finally:
        app[INFLIGHT_KEY].discard(transport)  # type: ignore[arg-type]
        if not handle.req.done:
            app[DRIVER_KEY].cancel(handle)


async def _completion_answer(request: web.Request, app: web.Application, kind: Kind, creq: CompletionRequest,
                             handle: RequestHandle, kv_params: dict[str, Any] | None) -> web.StreamResponse:
    words = filler_tokens(app[CONFIG_KEY].seed, creq.prompt_text, creq.output_tokens)
    rid = RID_PREFIX[kind] + uuid.uuid4().hex
    if creq.stream:
        stream = _stream_response if kind == "response" else _stream
        return await _serve(request, app, handle, stream(request, creq, handle, words, rid))
    return await _serve(request, app, handle, _unary(request, creq, handle, words, rid, kv_params))


# -- sglang's protocol: bootstrap rooms ---------------------------------------------------------


def _room_id(body: Any, code: str) -> int:
    room = body.get("bootstrap_room") if isinstance(body, dict) else None
    if not isinstance(room, int) or isinstance(room, bool) or room < 0:
        raise ApiError(400, "this is an sglang P/D instance: a request needs bootstrap_host, bootstrap_port and "
                            "bootstrap_room (a non-negative integer)", code=code, param="bootstrap_room")
    return room


def _open_room(app: web.Application, body: Any, creq: CompletionRequest) -> tuple[int, Room]:
    """A prefill request opens its room (a decode may already be waiting for it)."""
    room_id = _room_id(body, "bootstrap_room_missing")
    if room_id in app[ENDED_KEY]:
        raise ApiError(400, f"bootstrap room {room_id} was used already", code="bootstrap_room_used")
    rooms = app[ROOMS_KEY]
    room = rooms.setdefault(room_id, Room())
    if room.owned:
        raise ApiError(400, f"bootstrap room {room_id} is in use by another request", code="bootstrap_room_used")
    room.owned, room.prompt_tokens = True, creq.prompt_tokens
    return room_id, room


def _end_room(app: web.Application, room_id: int, room: Room) -> None:
    """The prefill request ended: a decode still waiting learns that no KV comes."""
    if not room.taken.is_set():
        room.failed = room.failed or f"the prefill request of bootstrap room {room_id} ended before a decode took its KV"
    room.ready.set()
    app[ROOMS_KEY].pop(room_id, None)
    ended = app[ENDED_KEY]
    ended[room_id] = room.failed or "its KV was taken"
    while len(ended) > ENDED_ROOMS:
        ended.popitem(last=False)


async def _sglang_prefill(app: web.Application, creq: CompletionRequest, handle: RequestHandle,
                          opened: tuple[int, Room]) -> web.StreamResponse:
    """Prefill, produce the one token, hold the answer until a decode took the KV (bounded)."""
    room_id, room = opened
    await handle.queue.get()  # the prefill step and its one token
    room.ready.set()
    timeout = app[CONFIG_KEY].bootstrap_timeout_s
    try:
        async with asyncio.timeout(timeout):
            await room.taken.wait()
    except TimeoutError:
        room.failed = f"no decode instance took the KV of bootstrap room {room_id} within {timeout:g} s"
        return _error(ApiError(500, room.failed, "InternalServerError", code="bootstrap_timeout"))
    words = filler_tokens(app[CONFIG_KEY].seed, creq.prompt_text, 1)
    shape = response_object if creq.kind == "response" else partial(full_response, creq.kind)
    return _json(shape(RID_PREFIX[creq.kind] + uuid.uuid4().hex, int(time.time()), creq.model, "".join(words),
                       "length", creq.prompt_tokens, 1))


async def bootstrap(request: web.Request) -> web.Response:
    """``GET /sim/bootstrap/<room>`` (a prefill instance's bootstrap server): wait for the room's
    prefill (up to --bootstrap-timeout-s), then hand its KV over: 200 with its prompt tokens;
    410 when the room's prefill failed or ended, 504 when none came."""
    app = request.app
    try:
        room_id = int(request.match_info["room"])
    except ValueError:
        return _json({"error": "a bootstrap room is an integer"}, 400)
    ended = app[ENDED_KEY].get(room_id)
    if ended is not None:
        return _json({"error": f"bootstrap room {room_id}: {ended}"}, 410)
    rooms, timeout = app[ROOMS_KEY], app[CONFIG_KEY].bootstrap_timeout_s
    room = rooms.setdefault(room_id, Room())
    room.waiters += 1
    transport = request.transport
    if transport is not None:
        app[INFLIGHT_KEY].add(transport)
    try:
        async with asyncio.timeout(timeout):
            await room.ready.wait()
    except TimeoutError:
        return _json({"error": f"bootstrap room {room_id}: no prefill request came within {timeout:g} s"}, 504)
    finally:
        app[INFLIGHT_KEY].discard(transport)  # type: ignore[arg-type]
        room.waiters -= 1
        if not room.owned and not room.waiters and rooms.get(room_id) is room:
            del rooms[room_id]
    if room.failed is not None or room.taken.is_set():
        return _json({"error": f"bootstrap room {room_id}: {room.failed or 'its KV was taken already'}"}, 410)
    room.taken.set()
    return _json({"room": room_id, "prompt_tokens": room.prompt_tokens})


async def _bootstrap(app: web.Application, body: Any) -> bool:
    """A decode leg meets its prefill at ``bootstrap_host:bootstrap_port`` in ``bootstrap_room``
    and takes the KV (True); an ApiError when it cannot: 400 without the fields, 500 when no KV comes."""
    room_id = _room_id(body, "bootstrap_missing")
    host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
    if not isinstance(host, str) or not host or not isinstance(port, int) or isinstance(port, bool):
        raise ApiError(400, "this is an sglang decode instance: a request needs bootstrap_host (a string) and "
                            "bootstrap_port (an integer)", code="bootstrap_missing", param="bootstrap_host")
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    timeout = app[CONFIG_KEY].bootstrap_timeout_s
    try:
        async with app[HTTP_KEY].get(f"http://{where}/sim/bootstrap/{room_id}",
                                     timeout=aiohttp.ClientTimeout(total=timeout + 5.0)) as resp:
            answer = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        why = f"no answer within {timeout + 5.0:g} s" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
        raise ApiError(500, f"bootstrap room {room_id}: the prefill instance at {where} failed: {why}",
                       "InternalServerError", code="bootstrap_failed") from None
    if resp.status != 200:
        message = answer.get("error") if isinstance(answer, dict) else None
        raise ApiError(500, f"bootstrap at {where}: {message or f'HTTP {resp.status}'}", "InternalServerError",
                       code="bootstrap_failed")
    return True


async def _bootstrap_client(app: web.Application) -> AsyncIterator[None]:
    async with aiohttp.ClientSession() as session:
        app[HTTP_KEY] = session
        yield


def _pd_leg(config: SimConfig, body: Any, creq: CompletionRequest, node_id: str, host: str | None,
            port: int | None) -> tuple[bool, dict[str, Any] | None]:
    """vLLM's P/D protocol as a KV connector plays it (docs/proxy.md, "Prefill/decode
    pairs"): ``(KV received, the kv_transfer_params to answer)``. A decode instance serves only a
    request carrying a prefill's ``kv_transfer_params`` (``do_remote_prefill``), else 400; a prefill
    instance asked ``do_remote_decode`` answers its one token with the params that name its KV."""
    params = body.get("kv_transfer_params") if isinstance(body, dict) else None
    if config.pd_role == NodeRole.DECODE:
        if params is None and config.pd_local_prefill:
            return False, None  # served whole: prefilled here (a kv_both engine, the proxy's decode-only path)
        if not isinstance(params, dict) or not params.get("do_remote_prefill") or not params.get("remote_engine_id"):
            raise ApiError(400, "this is a decode instance (kv_consumer): a request needs the kv_transfer_params "
                                "its prefill instance answered (do_remote_prefill, remote_engine_id)",
                           code="kv_transfer_params_missing", param="kv_transfer_params")
        return True, None
    if config.pd_role == NodeRole.PREFILL and isinstance(params, dict) and params.get("do_remote_decode"):
        blocks = -(-creq.prompt_tokens // 16)
        return False, {"do_remote_prefill": True, "do_remote_decode": False,
                       "remote_engine_id": node_id, "remote_block_ids": list(range(min(blocks, 1024))),
                       "remote_host": host, "remote_port": port, "tp_size": 1}
    return False, None


async def _unary(request: web.Request, creq: CompletionRequest, handle: RequestHandle,
                 words: list[str], rid: str, kv_params: dict[str, Any] | None = None) -> web.StreamResponse:
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
    answer = shape(rid, int(time.time()), creq.model, "".join(words), creq.finish_reason, creq.prompt_tokens,
                   creq.output_tokens)
    if kv_params is not None:
        answer["kv_transfer_params"] = kv_params
    return _json(answer)


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
        "fault_code": lambda v: isinstance(v, str) and (v == "" or (len(v) == 8 and all(
            c in "0123456789abcdefABCDEF" for c in v))),
    }
    hints = {"capacity": "an integer >= 0", "slowdown": "a number > 0", "fail": " | ".join(FAIL_MODES),
             "health": " | ".join(HEALTH_STATES), "cut_after": "an integer >= 1",
             "fault_code": "8 hex digits, or \"\" for none"}
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
    if "health" in changes:
        changes["health"] = NpuHealth(changes["health"])
    for key in ("fail", "health", "cut_after", "fault_code"):
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
        "fault_code": faults.fault_code, "pd_role": config.pd_role, "pd_protocol": config.pd_protocol,
        "bootstrap_rooms": sum(1 for room in app[ROOMS_KEY].values() if room.owned),
        "tokens_generated": driver.sim.tokens_generated, "requests_finished": driver.sim.requests_finished,
        "prefix_cache_queries": snap.prefix_cache_queries, "prefix_cache_hits": snap.prefix_cache_hits,
        "kv_events_subscribers": None if driver.kv_events is None else driver.kv_events.subscribers,
        "npu": {"name": profile.npu_name, "chips": profile.chips_per_npu, "aicore_pct": npu.aicore_pct,
                "hbm_used_mb": npu.hbm_used_mb, "hbm_total_mb": npu.hbm_total_mb,
                "power_w": npu.power_w, "temp_c": npu.temp_c},
    }


async def get_sim_state(request: web.Request) -> web.Response:
    return _json(sim_state(request.app))


async def get_status(request: web.Request) -> web.Response:
    return _json(mindie.status(sim_state(request.app), v2=request.path.startswith("/v2/")))


async def get_metrics_json(request: web.Request) -> web.Response:
    app = request.app
    instance = f"{request.host}"
    return _json(mindie.metrics_json(sim_state(app), app[METRICS_KEY].timings, instance))


async def get_sim_npu_exporter(request: web.Request) -> web.Response:
    app = request.app
    cache, now = app[EXPORTER_KEY], time.time()
    if cache.due(now):
        cache.text, cache.filled_at = mindie.exporter_text(sim_state(app), app[CONFIG_KEY].npu_id, now), now
    return web.Response(text=cache.text, content_type="text/plain")


async def get_sim_npu_smi(request: web.Request) -> web.Response:
    app = request.app
    return web.Response(text=npu_smi.render(sim_state(app), app[CONFIG_KEY].npu_id), content_type="text/plain")


# --------------------------------------------------------------------------- app


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG_KEY]
    publisher = None if config.kv_events is None else KvEventPublisher(config.kv_events, config.kv_events_replay)
    sim = EngineSim(config.profile, config.capacity, speed=config.speed, kv_tokens=config.kv_tokens,
                    kv_events=publisher is not None)
    driver = EngineDriver(sim, app[METRICS_KEY], publisher)
    app[DRIVER_KEY] = driver
    await driver.start()
    try:
        yield
    finally:
        await driver.stop()
        if publisher is not None:
            await publisher.close()


def init_app(config: SimConfig) -> web.Application:
    """The aiohttp application for one simulated engine (ValueError on a bad config).

    Run it with ``start_server`` (or an AppRunner with ``handler_cancellation=True``): without
    handler cancellation a client that leaves while its request waits is only noticed at the
    first write, so its slot is freed late.
    """
    config.validate()
    app = web.Application(middlewares=[refuse_middleware], client_max_size=config.max_body_bytes)
    app[CONFIG_KEY] = config
    app[FAULTS_KEY] = FaultState()
    app[METRICS_KEY] = SimMetrics(config.model_name, config.flavour)
    app[EXPORTER_KEY] = mindie.ExporterCache(update_s=config.exporter_update_s)
    app[STARTED_KEY] = time.time()
    app[NODE_KEY] = NodeName(config.node_id or f"{config.profile.chip}-{config.port}")
    app[INFLIGHT_KEY] = set()
    app[TOKENIZER_KEY] = None if config.tokenizer is None else PromptTokenizer(config.tokenizer)
    app[ROOMS_KEY] = {}
    app[ENDED_KEY] = OrderedDict()
    app.cleanup_ctx.append(_engine_ctx)
    if config.pd_protocol == PdProtocol.SGLANG and config.pd_role == NodeRole.DECODE:
        app.cleanup_ctx.append(_bootstrap_client)
    if config.pd_protocol == PdProtocol.SGLANG and config.pd_role == NodeRole.PREFILL:
        app.router.add_get("/sim/bootstrap/{room}", bootstrap)
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
    app.router.add_get("/sim/npu-exporter", get_sim_npu_exporter)
    if config.flavour == "mindie":
        app.router.add_get("/v1/status", get_status)
        app.router.add_get("/v2/status", get_status)
        app.router.add_get("/metrics-json", get_metrics_json)
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
    sites = [web.TCPSite(runner, config.host, config.port)]
    if config.bootstrap_port:  # an sglang prefill instance's bootstrap server
        sites.append(web.TCPSite(runner, config.host, config.bootstrap_port))
    try:
        for site in sites:
            await site.start()
    except OSError:
        await runner.cleanup()
        raise
    host, port = runner.addresses[0][:2]
    if config.node_id is None:  # name the node after the bound port
        app[NODE_KEY].value = f"{config.profile.chip}-{port}"
    host = f"[{host}]" if ":" in host else host
    return RunningServer(runner, f"http://{host}:{port}")

