"""Engine pollers: one ``/metrics`` scrape and one health probe over HTTP (aiohttp).

Theory of operation
-------------------
* The IO half of the engine collector; the pure half is ``collectors.prometheus``. These
  functions never raise for anything the remote side does: every outcome (answer, HTTP error,
  timeout, refused connection, garbage body) comes back as a value the caller counts and
  publishes. Only cancellation propagates.
* ``scrape_metrics`` returns a ``Scrape``: ``metrics`` set when the body parsed, else
  ``outcome`` names why not (``http_error``, ``timeout``, ``unreachable``, ``garbage``) and
  ``error`` says it in one line. A body larger than ``MAX_BODY_BYTES`` is garbage (a real
  engine's exposition is tens of KB).
* ``probe_health`` returns a ``HealthProbed`` event: ``ok`` iff the endpoint answered 2xx
  within the timeout; ``latency_ms`` is the time to the response status (None when no
  response came); ``error`` is ``"HTTP 503: <body start>"``, ``"timeout after 1000 ms"`` or
  ``"unreachable: <reason>"``. The producer timestamp is taken by the caller's clock.
* Each call gets its own ``ClientTimeout(total=...)``, so one slow node costs at most its
  own timeout; callers run nodes concurrently.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import aiohttp

from laswrr.collectors.errors import ParseError
from laswrr.collectors.prometheus import EngineKind, EngineMetrics, parse_engine_metrics
from laswrr.schemas.events import MAX_MODELS, HealthProbed

MAX_BODY_BYTES = 8 << 20
ERROR_BODY_CHARS = 120
Outcome = Literal["ok", "http_error", "timeout", "unreachable", "garbage"]


@dataclass(frozen=True, slots=True)
class Scrape:
    """The result of one ``/metrics`` scrape."""

    outcome: Outcome
    metrics: EngineMetrics | None = None
    error: str | None = None


class _BodyTooLarge(Exception):
    pass


async def _read_capped(response: aiohttp.ClientResponse) -> bytes:
    body = await response.content.read(MAX_BODY_BYTES + 1)
    if len(body) > MAX_BODY_BYTES:
        raise _BodyTooLarge(f"body exceeds {MAX_BODY_BYTES} bytes")
    return body


def _one_line(text: str, limit: int = ERROR_BODY_CHARS) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _transport_error(exc: BaseException, timeout_s: float) -> tuple[Outcome, str]:
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout", f"timeout after {timeout_s * 1000:.0f} ms"
    reason = str(exc) or type(exc).__name__
    return "unreachable", f"unreachable: {_one_line(reason)}"


async def get_text(session: aiohttp.ClientSession, url: str,
                   timeout_s: float) -> tuple[Outcome, str | None, str | None]:
    """GET ``url``: ``("ok", body, None)`` on a 200 answer within ``timeout_s``, else
    ``(outcome, None, one-line error)``; never raises for what the remote side does."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            body = await _read_capped(response)
            if response.status != 200:
                text = body.decode("utf-8", errors="replace")
                return "http_error", None, f"HTTP {response.status}: {_one_line(text)}"
    except _BodyTooLarge as exc:
        return "garbage", None, str(exc)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        outcome, error = _transport_error(exc, timeout_s)
        return outcome, None, error
    return "ok", body.decode("utf-8", errors="replace"), None


def models_url(url: str) -> str:
    """``GET /v1/models`` of the engine at node URL ``url``: the node-URL rule of the proxy's
    engine transport (services/proxy/transport.py, ``parse_target``): a node URL may end in
    ``/v1`` or not, and ``/v1/...`` is taken once either way."""
    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    return base + "/v1/models"


async def list_model_ids(session: aiohttp.ClientSession, url: str,
                         timeout_s: float) -> tuple[Outcome, list[str] | None, str | None]:
    """The model ids an OpenAI-compatible engine lists at ``url`` (``models_url``), in its
    order: ``("ok", ids, None)``, else ``(outcome, None, one-line error)`` (``garbage`` for an
    answer that is not an OpenAI model list); never raises for what the remote side does."""
    outcome, text, error = await get_text(session, url, timeout_s)
    if text is None:
        return outcome, None, error
    try:
        document = json.loads(text)
    except ValueError as exc:
        return "garbage", None, f"not JSON: {_one_line(str(exc))}"
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        return "garbage", None, "not an OpenAI model list (no data array)"
    ids = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str) and 0 < len(m["id"]) <= 256]
    return "ok", list(dict.fromkeys(ids))[:MAX_MODELS], None


async def scrape_metrics(session: aiohttp.ClientSession, url: str, timeout_s: float,
                         engine: EngineKind | Literal["auto"] = "auto") -> Scrape:
    """GET ``url`` and parse it as an engine's Prometheus exposition."""
    outcome, text, error = await get_text(session, url, timeout_s)
    if text is None:
        return Scrape(outcome, error=error)
    try:
        return Scrape("ok", metrics=parse_engine_metrics(text, engine))
    except ParseError as exc:
        return Scrape("garbage", error=str(exc))


async def probe_health(session: aiohttp.ClientSession, url: str, timeout_s: float,
                       clock_ns: Callable[[], int] = time.time_ns) -> HealthProbed:
    """GET ``url``: ok on 2xx within ``timeout_s``; never raises for remote failures."""
    started = time.monotonic()
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            latency_ms = round((time.monotonic() - started) * 1000.0, 3)
            if 200 <= response.status < 300:
                return HealthProbed(ok=True, latency_ms=latency_ms, ts_ns=clock_ns())
            text = (await response.content.read(ERROR_BODY_CHARS * 4)).decode("utf-8", errors="replace")
            error = f"HTTP {response.status}: {_one_line(text)}" if text.strip() else f"HTTP {response.status}"
            return HealthProbed(ok=False, latency_ms=latency_ms, error=error, ts_ns=clock_ns())
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        _, error = _transport_error(exc, timeout_s)
        return HealthProbed(ok=False, error=error, ts_ns=clock_ns())
