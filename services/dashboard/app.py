"""`laswrr dashboard`: one web page per deployment, live or over a recorded log (read-only).

Theory of operation. A ``Board`` (board.py) holds what the page shows. Its source is either

* **live** (``--nats-url``): ordered JetStream consumers, from ``--keep-s`` ago, on LB_OUT
  (``lb.out.>``: snapshots, phase changes, rejections) and on LB_EVENTS (``lb.admin.>``,
  ``lb.req.finished.>``, ``lb.req.batch.>`` (the proxies' request events, flow control's
  ``lb.req.queued`` among them), ``lb.metrics.npu.>``); every message goes through ``Board.apply`` and
  what it returns is pushed to every connected page over Server-Sent Events
  (``GET /api/events``: ``snapshot`` and ``mark`` events, a ``requests`` event per pool each
  second, ``hello`` on connect so a page that reconnects refetches the history it missed). A
  page that cannot keep up (its queue is full) is disconnected and reconnects by itself. The
  board forgets what is older than ``--keep-s``. Streams that do not exist yet are waited for.
* **recorded** (``--db events.duckdb``): every such row of the ``events`` table, folded once
  at start in time order; the page shows a time scrubber over the log's range (a file the
  recorder holds is read through a consistent copy it makes, as ``laswrr report --db`` does).

HTTP, all GET: ``/`` the page (static files inside this package: no CDN, no build step),
``/api/ws`` the same live push over a WebSocket (what the page uses: it does not hold the page's
load, so a headless screenshot returns), ``/api/state[?at=<ms>]`` the node table of every pool with its request statistics, as of now or
of ``at`` (plus ``mode`` and the log's ``range_ms``), ``/api/history?at=<ms>&window=<s>`` the
curves and marks before ``at``, ``/api/events`` the live push. Nothing here publishes to NATS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from laswrr.replay import store
from laswrr.schemas import subjects as sj
from laswrr.services import settings
from laswrr.services.dashboard.board import MS, S, Board, Push
from laswrr.services.jsreader import parse_ack_subject
from laswrr.services.natsbus import NatsAuth, connect, redact_url
from laswrr.services.tasks import stop_task

log = logging.getLogger("laswrr.dashboard")

STATIC = Path(__file__).parent / "static"
DEFAULT_PORT = 8090
LISTEN_PREFIX = "dashboard listening on "
CLIENT_QUEUE = 2000  # pushes waiting for one page before it is dropped
LIVE_SUBJECTS = ((sj.OUT_STREAM, sj.OUT_ALL), (sj.EVENTS_STREAM, sj.ADMIN_ALL),
                 (sj.EVENTS_STREAM, f"{sj.REQ_FINISHED}.>"), (sj.EVENTS_STREAM, f"{sj.REQ_BATCH}.>"),
                 (sj.EVENTS_STREAM, f"{sj.METRICS_NPU}.>"))


@dataclass
class DashboardConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    nats_url: str = settings.DEFAULT_NATS_URL
    nats_auth: NatsAuth | None = None  # credential files beside the URL's; None: from the environment
    db: Path | None = None  # recorded mode
    window_s: float = 300.0  # the curves' default time span
    keep_s: float = 900.0  # live: how far back the board reaches


@dataclass
class Hub:
    """The connected pages' queues."""

    clients: set[asyncio.Queue[tuple[str, str] | None]] = field(default_factory=set)

    def publish(self, event: str, data: Any) -> None:
        text = json.dumps(data, separators=(",", ":"))
        for queue in list(self.clients):
            try:
                queue.put_nowait((event, text))
            except asyncio.QueueFull:  # too slow: drop it; its EventSource reconnects
                self.clients.discard(queue)
                with contextlib.suppress(asyncio.QueueFull):
                    queue.get_nowait()
                    queue.put_nowait(None)


@dataclass
class Dashboard:
    config: DashboardConfig
    board: Board
    hub: Hub = field(default_factory=Hub)
    live: bool = True
    clock_ns: Callable[[], int] = time.time_ns
    started_ms: int = field(default_factory=lambda: time.time_ns() // MS)

    def now_ns(self) -> int:
        if self.live:
            return self.clock_ns()
        return self.board.last_ns or 0

    def push(self, pushes: list[Push]) -> None:
        for item in pushes:
            self.hub.publish(item.kind, {"pool": item.pool, **item.data})


DASHBOARD = web.AppKey("dashboard", Dashboard)


# -- HTTP ---------------------------------------------------------------------------------------------


def _query_ns(request: web.Request, dash: Dashboard) -> int:
    raw = request.query.get("at")
    if raw is None or raw == "":
        return dash.now_ns()
    try:
        return int(float(raw) * MS)
    except ValueError:
        raise web.HTTPBadRequest(text=json.dumps({"error": f"at must be milliseconds since the epoch, got {raw!r}"}),
                                 content_type="application/json") from None


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html")


async def api_state(request: web.Request) -> web.Response:
    dash = request.app[DASHBOARD]
    board = dash.board
    body = {"mode": "live" if dash.live else "recorded", **board.state(_query_ns(request, dash)),
            "range_ms": [None if board.first_ns is None else board.first_ns // MS,
                         None if board.last_ns is None else board.last_ns // MS],
            "window_s": dash.config.window_s, "source": str(dash.config.db) if dash.config.db else
            redact_url(dash.config.nats_url)}
    return web.json_response(body)


async def api_history(request: web.Request) -> web.Response:
    dash = request.app[DASHBOARD]
    raw = request.query.get("window", str(dash.config.window_s))
    try:
        window = float(raw)
        if not 0 < window <= 86400:
            raise ValueError
    except ValueError:
        return web.json_response({"error": f"window must be seconds in (0, 86400], got {raw!r}"}, status=400)
    return web.json_response(dash.board.history(_query_ns(request, dash), window))


async def api_events(request: web.Request) -> web.StreamResponse:
    dash = request.app[DASHBOARD]
    if not dash.live:
        return web.json_response({"error": "a recorded log has no live events"}, status=404)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    queue: asyncio.Queue[tuple[str, str] | None] = asyncio.Queue(CLIENT_QUEUE)
    dash.hub.clients.add(queue)
    try:
        await response.write(_sse("hello", json.dumps({"started_ms": dash.started_ms})))
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), 15.0)
            except asyncio.TimeoutError:
                await response.write(b": keep-alive\n\n")
                continue
            if item is None:
                break
            await response.write(_sse(*item))
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        dash.hub.clients.discard(queue)
    return response


async def api_ws(request: web.Request) -> web.StreamResponse:
    """The same pushes as ``/api/events``, over a WebSocket: what the page uses. An open
    EventSource counts as a network fetch still loading, so a headless capture
    (``chromium --headless=new --virtual-time-budget=8000 --screenshot URL``) waited for it for
    ever; a WebSocket does not hold the page's load, so the capture returns with the page drawn."""
    dash = request.app[DASHBOARD]
    if not dash.live:
        return web.json_response({"error": "a recorded log has no live events"}, status=404)
    ws = web.WebSocketResponse(heartbeat=15.0)
    await ws.prepare(request)
    queue: asyncio.Queue[tuple[str, str] | None] = asyncio.Queue(CLIENT_QUEUE)
    dash.hub.clients.add(queue)
    try:
        await ws.send_str(_frame("hello", json.dumps({"started_ms": dash.started_ms})))
        while not ws.closed:
            item = await queue.get()
            if item is None:
                break
            await ws.send_str(_frame(*item))
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        dash.hub.clients.discard(queue)
        await ws.close()
    return ws


def _frame(event: str, data: str) -> str:
    return f'{{"event":{json.dumps(event)},"data":{data}}}'


def _sse(event: str, data: str) -> bytes:
    return f"event: {event}\ndata: {data}\n\n".encode()


def init_app(dash: Dashboard) -> web.Application:
    app = web.Application()
    app[DASHBOARD] = dash
    app.router.add_get("/", index)
    app.router.add_get("/api/state", api_state)
    app.router.add_get("/api/history", api_history)
    app.router.add_get("/api/events", api_events)
    app.router.add_get("/api/ws", api_ws)
    app.router.add_static("/static/", STATIC, show_index=False)
    if dash.live:
        app.cleanup_ctx.append(_live_source)
    return app


# -- sources ------------------------------------------------------------------------------------------


async def _live_source(app: web.Application) -> Any:
    dash = app[DASHBOARD]
    task = asyncio.create_task(follow_live(dash))
    yield
    await stop_task(task)  # cancelled again and again: one cancel inside a nats-py request can be lost


async def follow_live(dash: Dashboard) -> None:
    """Subscribe (waiting for NATS and the streams), then push request statistics every second."""
    nc = await connect(dash.config.nats_url, "laswrr-dashboard", dash.config.nats_auth, error_cb=_quiet)
    try:
        since = datetime.datetime.fromtimestamp(time.time() - dash.config.keep_s, tz=datetime.timezone.utc)

        async def on_msg(msg: Msg) -> None:
            dash.push(dash.board.apply(msg.subject, parse_ack_subject(msg.reply).ts_ns, msg.data))

        pending = list(LIVE_SUBJECTS)
        while pending:
            stream, subject = pending[0]
            try:
                await nc.jetstream().subscribe(subject, stream=stream, cb=on_msg, ordered_consumer=True,
                                               config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME,
                                                                     opt_start_time=since))
                pending.pop(0)
            except NotFoundError:
                log.info("stream %s not there yet; retrying", stream)
                await asyncio.sleep(2.0)
        log.info("following %s", redact_url(dash.config.nats_url))
        while True:
            await asyncio.sleep(1.0)
            now = dash.now_ns()
            dash.board.trim(now - int(dash.config.keep_s * S))
            for pool in dash.board.pools:
                stats = dash.board.request_stats(pool, now)
                bins = dash.board.rate_bins(pool, now - 2 * S, now)
                dash.hub.publish("requests", {"pool": pool, "at_ms": now // MS, **stats, "rate": bins,
                                              "queue": dash.board.queue_depth(pool, now)})
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


async def _quiet(exc: Exception) -> None:
    log.debug("NATS: %s", exc)


RECORDED_SQL = f"""
SELECT ts_ns, subject, {store.PAYLOAD_SQL} AS payload FROM events
WHERE {" OR ".join(f"subject LIKE '{family}.%'" for family in (sj.OUT, sj.ADMIN, sj.REQ_FINISHED,
                                                                  sj.REQ_BATCH, sj.METRICS_NPU))}
ORDER BY ts_ns, stream, seq
"""


def load_recorded(db: Path, nats_url: str, auth: NatsAuth | None = None) -> Board:
    """The board of a whole recorded log (StoreError when it cannot be read)."""
    from laswrr.services.recorder_copy import copy_from_recorder

    board = Board()
    with store.open_read(db, copy_from_recorder(nats_url, auth=auth)) as con:
        cursor = con.execute(RECORDED_SQL)
        while rows := cursor.fetchmany(10_000):
            for ts_ns, subject, payload in rows:
                board.apply(subject, int(ts_ns), bytes(payload))
    return board


# -- command line -------------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("dashboard", help="the live operations page (or a recorded log's, with --db)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    settings.add_nats_options(parser)
    parser.add_argument("--host", default=DashboardConfig.host, help="listen address (default %(default)s)")
    parser.add_argument("--port", type=settings.port_number, default=DashboardConfig.port,
                        help="listen port (default %(default)s; 0 picks a free one)")
    parser.add_argument("--db", type=Path, default=None, metavar="events.duckdb",
                        help="show this recorded log with a time scrubber instead of the live stack")
    parser.add_argument("--window-s", type=settings.duration("s"), default=DashboardConfig.window_s,
                        help="time span of the curves (default %(default)s)")
    parser.add_argument("--keep-s", type=settings.duration("s"), default=DashboardConfig.keep_s,
                        help="live: how far back the page can look (default %(default)s)")
    settings.add_logging(parser)
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    settings.configure_logging(args, "dashboard")
    if args.window_s <= 0 or args.keep_s < args.window_s:
        print("laswrr dashboard: --window-s must be > 0 and --keep-s >= --window-s", file=sys.stderr)
        return 2
    config = DashboardConfig(host=args.host, port=args.port, nats_url=args.nats_url, db=args.db,
                             window_s=args.window_s, keep_s=args.keep_s, nats_auth=settings.nats_auth(args))
    if config.db is not None:
        try:
            board = load_recorded(config.db, config.nats_url, config.nats_auth)
        except store.StoreError as exc:
            print(f"laswrr dashboard: {exc}", file=sys.stderr)
            return 2
        dash = Dashboard(config, board, live=False)
    else:
        dash = Dashboard(config, Board())
    return asyncio.run(serve(dash))


async def serve(dash: Dashboard) -> int:
    stop = settings.stop_event()
    runner = web.AppRunner(init_app(dash), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, dash.config.host, dash.config.port)
    try:
        await site.start()
    except OSError as exc:
        print(f"laswrr dashboard: cannot listen on {dash.config.host}:{dash.config.port}: {exc.strerror}",
              file=sys.stderr)
        await runner.cleanup()
        return 1
    port = runner.addresses[0][1]
    print(f"{LISTEN_PREFIX}http://{dash.config.host}:{port}/", flush=True)
    try:
        await stop.wait()
    finally:
        for queue in list(dash.hub.clients):  # end every page's stream, so cleanup does not wait on them
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(None)
        await runner.cleanup()
    return 0
