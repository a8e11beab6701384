"""Open-loop load generator: sends a pre-generated workload as streaming chat completions.

Theory of operation:

* **Open loop.** A dispatcher sleeps until each request's arrival offset (on the event loop's
  monotonic clock, from a shared ``t0`` so scenario actions line up) and starts it as its own
  task; a slow system does not slow the arrivals (closed-loop generators hide tail latency).
* **Per request** the client records start, TTFT (first data chunk with content), E2E (``[DONE]``),
  the node that served it (``x-laswrr-node``; ``x-sim-node`` when talking to an engine directly),
  the proxy's request id (``x-laswrr-request-id``), with ``usage`` the engine's usage chunk (the
  prompt tokens it counted and found cached; not a token of the answer) and the outcome:
    - ``completed``: ``data: [DONE]`` arrived (E2E is stamped then; the client still reads the
      stream to its end, as the official ``openai`` client does, so the proxy sees a clean finish);
    - ``client_cancelled``: the workload's cancel delay passed first and the client hung up;
    - ``error``: non-200 status, connection failure before the response, or an SSE error event
      before any token;
    - ``interrupted``: the stream ended (EOF, a broken connection, or an SSE error event after
      the first token) without [DONE]: a cut the client sees, which the router must never cause
      and which continuing a broken stream on another node prevents when an engine dies.
* No model is sent unless asked: the proxy then routes to pool ``default`` and every engine
  accepts the request whatever its own model id is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from laswrr.bench.metrics import ClientOutcome, RequestResult
from laswrr.bench.workload import RequestSpec, prompt_text

NODE_HEADERS = ("x-laswrr-node", "x-sim-node")
REQUEST_ID_HEADER = "x-laswrr-request-id"
DONE = b"data: [DONE]"
OnDone = Callable[[RequestResult], None]


@dataclass(slots=True)
class _Progress:
    """What one in-flight request has seen so far (survives cancellation of its task)."""

    start: float
    node: str | None = None
    status: int | None = None
    ttft: float | None = None
    tokens: int = 0
    outcome: ClientOutcome = ClientOutcome.INTERRUPTED
    error: str = ""
    done_at: float | None = None  # [DONE] seen
    ended: float | None = None  # connection released
    request_id: str = ""  # x-laswrr-request-id
    usage: dict[str, Any] | None = None  # the engine's usage chunk (stream_options.include_usage)


@dataclass(slots=True)
class LoadRun:
    """The results of one run, in workload order once ``run`` returns."""

    results: list[RequestResult] = field(default_factory=list)
    launched: int = 0


def request_body(spec: RequestSpec, model: str | None, usage: bool = False) -> dict[str, Any]:
    """``usage``: ask for the engine's usage chunk (``stream_options.include_usage``), which
    carries the prompt tokens it found cached (``prompt_tokens_details.cached_tokens``)."""
    body: dict[str, Any] = {
        "messages": [{"role": role, "content": text} for role, text in spec.messages]
        or [{"role": "user", "content": prompt_text(spec)}],
        "max_tokens": spec.max_tokens,
        "stream": True,
    }
    if usage:
        body["stream_options"] = {"include_usage": True}
    if model is not None:
        body["model"] = model
    return body


def usage_of(payload: bytes) -> dict[str, Any] | None:
    """The ``usage`` of a usage-only chunk (no choices: what ``include_usage`` adds last)."""
    try:
        chunk = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        return None
    if not isinstance(chunk, dict) or chunk.get("choices") or not isinstance(chunk.get("usage"), dict):
        return None
    return chunk["usage"]


def cached_of(usage: dict[str, Any] | None) -> int | None:
    """The prompt tokens the engine found cached, as its usage says (vLLM with
    ``--enable-prompt-tokens-details``); no details: 0 (vLLM leaves them out when it counted
    none), no usage: None."""
    if usage is None:
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) else 0


def _error_message(payload: bytes) -> str:
    try:
        data = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        return payload[:200].decode(errors="replace")
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message", ""))[:200]
    return payload[:200].decode(errors="replace")


def _has_content(payload: bytes) -> bool:
    try:
        chunk = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        return False
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not choices:
        return False
    choice = choices[0]
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


async def _read_stream(resp: aiohttp.ClientResponse, progress: _Progress, now: Callable[[], float]) -> None:
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        if line.startswith(DONE):
            progress.outcome, progress.done_at = ClientOutcome.COMPLETED, now()
            async for _ in resp.content:  # read to the end, as the openai client does
                pass
            return
        payload = line[5:].strip()
        if b'"error"' in payload and b'"choices"' not in payload:
            cut = progress.ttft is not None  # the client already had part of the answer
            progress.outcome = ClientOutcome.INTERRUPTED if cut else ClientOutcome.ERROR
            progress.error = _error_message(payload)
            return
        if b'"usage"' in payload and (usage := usage_of(payload)) is not None:
            progress.usage = usage  # not a token
            continue
        progress.tokens += 1
        if progress.ttft is None and _has_content(payload):
            progress.ttft = now() - progress.start
    progress.error = "stream ended without [DONE]"


def request_headers(spec: RequestSpec) -> dict[str, str]:
    """A tenant's API key (``bench-<tenant>``, as ``keys_file_text`` writes it) and its priority."""
    headers = {}
    if spec.tenant:
        headers["Authorization"] = f"Bearer bench-{spec.tenant}"
    if spec.priority:
        headers["x-laswrr-priority"] = spec.priority
    return headers


def keys_file_text(tenants: Sequence[str]) -> str:
    """The API-keys file of a multi-tenant workload: ``<tenant>:bench-<tenant>`` per tenant."""
    return "".join(f"{name}:bench-{name}\n" for name in tenants)


async def _exchange(session: aiohttp.ClientSession, url: str, body: dict[str, Any], progress: _Progress,
                    now: Callable[[], float], headers: dict[str, str] | None = None) -> None:
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            progress.status = resp.status
            progress.node = next((resp.headers[h] for h in NODE_HEADERS if h in resp.headers), None)
            progress.request_id = resp.headers.get(REQUEST_ID_HEADER, "")
            if resp.status != 200:
                progress.outcome, progress.error = ClientOutcome.ERROR, _error_message(await resp.read())
                return
            await _read_stream(resp, progress, now)
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
        # a broken stream after the response started is an interruption, before it an error
        if progress.status is None:
            progress.outcome = ClientOutcome.ERROR
        progress.error = f"{type(exc).__name__}: {exc}"[:200]
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        progress.outcome = ClientOutcome.ERROR if progress.status is None else ClientOutcome.INTERRUPTED
        progress.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        progress.ended = now()


async def send_one(session: aiohttp.ClientSession, url: str, spec: RequestSpec, t0: float,
                   model: str | None = None, usage: bool = False) -> RequestResult:
    """Send one request now; honour its cancel delay; return what the client saw."""
    loop = asyncio.get_running_loop()

    def now() -> float:
        return loop.time() - t0

    progress = _Progress(start=now())
    task = asyncio.create_task(_exchange(session, url, request_body(spec, model, usage), progress, now,
                                         request_headers(spec) or None))
    if spec.cancel_after_s is None:
        await task
    else:
        done, _ = await asyncio.wait({task}, timeout=spec.cancel_after_s)
        if not done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if progress.outcome != ClientOutcome.COMPLETED:  # [DONE] may have come while reading to the end
                progress.outcome, progress.error = ClientOutcome.CLIENT_CANCELLED, ""
    end = progress.ended if progress.ended is not None else now()
    completed = progress.outcome == ClientOutcome.COMPLETED
    e2e = progress.done_at - progress.start if completed and progress.done_at else None
    return RequestResult(index=spec.index, start_s=round(progress.start, 6), end_s=round(end, 6),
                         ttft_s=None if progress.ttft is None else round(progress.ttft, 6),
                         e2e_s=None if e2e is None else round(e2e, 6), node=progress.node,
                         outcome=progress.outcome, status=progress.status, tokens=progress.tokens,
                         error=progress.error, tenant=spec.tenant, priority=spec.priority,
                         max_tokens=spec.max_tokens, request_id=progress.request_id,
                         cached_tokens=cached_of(progress.usage),
                         prompt_tokens=None if progress.usage is None else progress.usage.get("prompt_tokens"))


def make_session(timeout_s: float = 600.0) -> aiohttp.ClientSession:
    """A session with no connection cap (open loop) and no pooling surprises."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False, enable_cleanup_closed=True)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                 auto_decompress=False)


async def run_load(base_url: str | Sequence[str], workload: Sequence[RequestSpec], t0: float, *,
                   model: str | None = None, on_done: OnDone | None = None,
                   session: aiohttp.ClientSession | None = None, usage: bool = False) -> LoadRun:
    """Send ``workload`` to ``base_url`` (a proxy or an engine), each at ``t0 + offset``. Several
    URLs (proxy replicas): the requests alternate among them in arrival order, as an L4 balancer's
    round robin would spread them, unless a request names its ``entry`` (URL index, modulo their number).
    ``usage``: ask each answer for the engine's usage chunk (``request_body``)."""
    bases = [base_url] if isinstance(base_url, str) else list(base_url)
    if not bases:
        raise ValueError("run_load needs at least one URL")
    urls = [base.rstrip("/") + "/v1/chat/completions" for base in bases]
    run = LoadRun()
    own_session = session is None
    session = session or make_session()
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[RequestResult]] = []

    def finished(task: asyncio.Task[RequestResult]) -> None:
        if on_done is not None and not task.cancelled() and task.exception() is None:
            on_done(task.result())

    try:
        for i, spec in enumerate(workload):
            delay = t0 + spec.offset_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send_one(session, urls[(i if spec.entry is None else spec.entry) % len(urls)], spec, t0,
                                                 model, usage))
            task.add_done_callback(finished)
            tasks.append(task)
            run.launched += 1
        run.results = sorted(await asyncio.gather(*tasks), key=lambda r: r.index)
    finally:
        for task in tasks:
            task.cancel()
        if own_session:
            await session.close()
    return run
