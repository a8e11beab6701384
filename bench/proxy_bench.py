"""Proxy overhead benchmark: requests/s, added latency at half the saturating rate, events
dropped, CPU per request per process and an exact replay, direct vs our stack vs vllm-router.

    python -m laswrr.bench.proxy_bench [--duration 6] [--connections 64] [--rounds 2] [--out bench-out/proxy_bench.json]
    LASWRR_PEER_INTERVAL_MS=0 python -m laswrr.bench.proxy_bench ...   (the proxies without the channel between proxies)

One run starts, as separate processes on this machine, through ``laswrr up``'s ``Stack``
(services/up.py): two instant engines (below), an embedded nats-server, the real stack
(``laswrr scheduler``, ``laswrr recorder``, and two proxies on the same engines: ``laswrr proxy
--workers 1`` and ``laswrr proxy --workers 2``; nodes registered with ``lb.admin.node.<id>`` as
an operator would) and, when installed, ``vllm-router`` (PyPI ``vllm-router``, the project's
optional ``peers`` extra) on the same two engines. Logs: ``<workdir>/data/logs/<name>.log``. Then, for each target, in this order:

* **saturating throughput**: ``--connections`` keep-alive connections for ``--duration`` s; its
  requests/s is the target's saturating rate R, and the CPU time each process spent on them
  (for the stack until the scheduler and the recorder caught up) divided by the requests
  served is the CPU per request.
* **half the saturating rate**: requests paced at R/2 for ``--latency-duration`` s (each of
  enough connections waits a fixed pause after every answer; a 1 s calibration run first sets
  the count; the achieved rate is reported). Its P50 and P99, and those of the direct engine
  paced at R/4 (the rate each of the two engines sees behind a router at R/2), give the added
  latency: target - direct, per percentile. The proxies' ``laswrr_proxy_events_dropped_total``
  before and after gives the events dropped at that rate, and the CPU per request there too.
* **streamed**: the saturating run again with ``"stream": true`` (SSE); requests/s.

Targets: ``direct`` (one engine, no router: the floor), ``laswrr-w1`` and ``laswrr-w2`` (the
proxy with ``--workers 1`` / ``--workers 2``, publishing every event to JetStream, with the
scheduler and the recorder running: the whole stack), ``laswrr-w1-proxy-only`` (``--workers
1`` with scheduler and recorder paused by SIGSTOP: what the proxy alone costs), ``vllm-router``
(``--policy round_robin``). Targets run interleaved for ``--rounds`` rounds (the machine may be
shared; the best round is kept: highest req/s, latency from the round with the lowest added
P50), each after the stack went idle. Last, the stack stops in ``laswrr up``'s order (proxies,
engines, scheduler, recorder, NATS) and ``laswrr replay --db`` runs on the recorded log: ``replay_exact``.

The proxies' request events go to JetStream in batches (``lb.req.batch.<proxy>``);
``notes.event_batches`` is each proxy process's batch-size histogram over the whole run, as its
``/metrics`` shows it (events per batch, and the batches at or below each bound);
``notes.channel`` what each sent on the channel between proxies over the run (messages, whole
views, bytes with the subjects, against its request events' bytes; None for one that does not
share). In the stack every proxy serves the same pool, so the two proxies and the workers of
``--workers 2`` are replicas that hear each other.

CPU per request: utime+stime from /proc (a proxy with workers: the parent and its workers).
Unlike requests/s, it does not depend on what else runs on the machine, and shows where the time
goes. When the machine's cores are the bottleneck (as on a 2-core box), requests/s of a target
tends to cores / its total CPU per request, so ``cpu_bound_ratio_vs_vllm_router`` (vllm-router's
total CPU per request over ours, engines included in both, the load generator in neither) is
the ratio the measured one approaches on a busy machine.

The load generator is ``wrk`` (C, one thread): when it is missing, the bench installs it
(``apt-get install -y wrk``, when running as root where apt exists), else it says so and uses a
lean asyncio client in its own process (``python -m laswrr.bench.proxy_bench load``). The
engine is a raw asyncio HTTP/1.1 server answering at once with a fixed completion (JSON, or SSE
when the body asks for ``"stream": true``), so neither is the bottleneck.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from laswrr.collectors.nodes import Node
from laswrr.services import settings
from laswrr.services.nats_server import free_ports
from laswrr.services.up import Stack

CHAT_BODY = {"model": "bench-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
STREAM_BODY = dict(CHAT_BODY, stream=True)
LISTEN = "listening on "

# -- the instant engine -------------------------------------------------------------------------

_JSON = json.dumps({
    "id": "cmpl-bench", "object": "chat.completion", "created": 1, "model": "bench-model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok ok ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}).encode()
_CHUNK = b'data: {"id":"cmpl-bench","object":"chat.completion.chunk","created":1,"model":"bench-model",' \
         b'"choices":[{"index":0,"delta":{"content":"ok "},"finish_reason":null}]}\n\n'
_SSE = _CHUNK * 3 + b'data: [DONE]\n\n'
_MODELS = json.dumps({"object": "list", "data": [{"id": "bench-model", "object": "model", "owned_by": "bench"}]}).encode()


def _response(status: str, content_type: str, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            f"x-engine: bench\r\n\r\n").encode() + body


def _sse_response(body: bytes) -> bytes:
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            b"Cache-Control: no-cache\r\n\r\n") + chunked


RESPONSES = {
    "json": _response("200 OK", "application/json", _JSON),
    "sse": _sse_response(_SSE),
    "models": _response("200 OK", "application/json", _MODELS),
    "health": _response("200 OK", "text/plain", b"ok"),
    "missing": _response("404 Not Found", "application/json", b'{"error": {"message": "not found"}}'),
}


class EngineProtocol(asyncio.Protocol):
    """Minimal HTTP/1.1 keep-alive server: parse head + Content-Length body, answer at once."""

    def __init__(self) -> None:
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4:end + 4 + length]
            self.buffer = self.buffer[end + 4 + length:]
            assert self.transport is not None
            self.transport.write(self._answer(head.split(" ", 2), body))

    @staticmethod
    def _answer(request_line: list[str], body: bytes) -> bytes:
        method, path = request_line[0], request_line[1] if len(request_line) > 1 else "/"
        if method == "POST" and path.startswith(("/v1/chat/completions", "/v1/completions")):
            streamed = b'"stream": true' in body or b'"stream":true' in body
            return RESPONSES["sse" if streamed else "json"]
        if path.startswith("/v1/models"):
            return RESPONSES["models"]
        if path.startswith("/health"):
            return RESPONSES["health"]
        return RESPONSES["missing"]


async def serve_engine(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(EngineProtocol, host, port, backlog=1024)
    print(f"engine {LISTEN}http://{host}:{server.sockets[0].getsockname()[1]}", flush=True)
    await settings.stop_event().wait()
    server.close()


# -- the fallback load generator ------------------------------------------------------------------

def _request_bytes(url: str, body: bytes) -> tuple[str, int, bytes]:
    rest = url.split("://", 1)[1]
    hostport, _, path = rest.partition("/")
    host, _, port = hostport.partition(":")
    head = (f"POST /{path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return host, int(port or 80), head + body


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            await reader.readexactly(size + 2)
            if size == 0:
                return status
    index = lower.find(b"content-length:")
    length = int(lower[index + 15:lower.index(b"\r\n", index)]) if index >= 0 else 0
    await reader.readexactly(length)
    return status


async def _connection(host: str, port: int, request: bytes, deadline: float, latencies: list[float],
                      errors: list[int], pause_s: float) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            writer.write(request)
            status = await _read_response(reader)
            latencies.append(time.perf_counter() - t0)
            if status >= 400:
                errors.append(status)
            if pause_s:
                await asyncio.sleep(pause_s)
    finally:
        writer.close()


async def python_load(url: str, body: bytes, connections: int, duration: float, pause_ms: int = 0) -> dict[str, Any]:
    host, port, request = _request_bytes(url, body)
    latencies: list[float] = []
    errors: list[int] = []
    start = time.perf_counter()
    await asyncio.gather(*(_connection(host, port, request, start + duration, latencies, errors, pause_ms / 1000)
                           for _ in range(connections)))
    elapsed = time.perf_counter() - start
    return _summary(len(latencies), elapsed, len(errors), sorted(latencies))


def _summary(requests: int, elapsed: float, errors: int, ordered: list[float]) -> dict[str, Any]:
    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000 if ordered else float("nan")
    mean = sum(ordered) / len(ordered) * 1000 if ordered else float("nan")
    return {"requests": requests, "rps": requests / elapsed, "errors": errors,
            "p50_ms": pct(0.5), "p90_ms": pct(0.9), "p99_ms": pct(0.99), "mean_ms": mean}


# -- wrk ------------------------------------------------------------------------------------------

WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = %s
wrk.headers["Content-Type"] = "application/json"
local pause = %d
if pause > 0 then
  delay = function() return pause end
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("WRKJSON {\\"requests\\": %%d, \\"duration_us\\": %%d, \\"errors\\": %%d, \\"non2xx\\": %%d, " ..
    "\\"p50_us\\": %%d, \\"p90_us\\": %%d, \\"p99_us\\": %%d, \\"mean_us\\": %%f}\\n", summary.requests, summary.duration,
    e.connect + e.read + e.write + e.timeout, e.status, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.mean))
end
"""


def wrk_load(url: str, body: bytes, connections: int, duration: float, workdir: Path, pause_ms: int = 0) -> dict[str, Any]:
    script = workdir / f"wrk-{abs(hash(body))}-{pause_ms}.lua"
    script.write_text(WRK_SCRIPT % (json.dumps(body.decode()), pause_ms))
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "--timeout", "10s",
                          "-s", str(script), url], capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("WRKJSON "))
    data = json.loads(line[len("WRKJSON "):])
    seconds = data["duration_us"] / 1e6
    return {"requests": data["requests"], "rps": data["requests"] / seconds, "errors": data["errors"] + data["non2xx"],
            "p50_ms": data["p50_us"] / 1000, "p90_ms": data["p90_us"] / 1000, "p99_ms": data["p99_us"] / 1000,
            "mean_ms": data["mean_us"] / 1000}


def load(url: str, body: dict[str, Any], connections: int, duration: float, workdir: Path,
         pause_ms: int = 0) -> dict[str, Any]:
    """``connections`` keep-alive connections for ``duration`` s, each pausing ``pause_ms`` after
    every answer (0: none, saturating); requests/s, errors, P50/P90/P99 and mean in ms."""
    payload = json.dumps(body).encode()
    if shutil.which("wrk"):
        return wrk_load(url, payload, connections, duration, workdir, pause_ms)
    out = subprocess.run([sys.executable, "-m", "laswrr.bench.proxy_bench", "load", "--url", url, "--body", payload.decode(),
                          "-c", str(connections), "-d", str(duration), "--pause-ms", str(pause_ms)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


PAUSE_MS = 10  # the paced runs' pause after each answer (wrk's delay() counts whole ms)


def paced_load(url: str, rate: float, duration: float, workdir: Path) -> dict[str, Any]:
    """Requests at about ``rate``/s: N connections, each pausing PAUSE_MS after every answer, so
    the rate is N / (pause + latency); a 1 s run measures the latency, then N is set from it."""
    def connections(latency_ms: float) -> int:
        return max(1, round(rate * (PAUSE_MS + latency_ms) / 1000))

    calibration = load(url, CHAT_BODY, connections(1.0), 1.0, workdir, PAUSE_MS)
    count = connections(calibration["mean_ms"])
    result = load(url, CHAT_BODY, count, duration, workdir, PAUSE_MS)
    return {**result, "connections": count, "asked_rps": rate}


def ensure_wrk() -> str:
    """wrk, installed when missing (Debian's package, as root where apt exists); else the reason
    the Python generator is used."""
    if shutil.which("wrk"):
        return "wrk"
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        print("proxy benchmark: installing wrk (apt-get install -y wrk)", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-q", "wrk"]
        if subprocess.run(install, capture_output=True, env=env).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env)
            subprocess.run(install, capture_output=True, env=env)
        if shutil.which("wrk"):
            return "wrk"
    print("proxy benchmark: note: wrk is not installed and could not be installed here (it needs root and apt-get); "
          "using the Python load generator, whose own CPU competes with the targets", flush=True)
    return "python"


# -- the stack ------------------------------------------------------------------------------------

@dataclass
class Result:
    target: str
    rps: float  # saturating
    rps_stream: float
    # at half the saturating rate (None for ``direct``, the floor itself: each router's floor is
    # the direct engine paced at the rate each engine sees behind it)
    half_rps: float | None  # achieved
    p50_ms: float | None
    p99_ms: float | None
    direct_p50_ms: float | None
    direct_p99_ms: float | None
    added_p50_ms: float | None
    added_p99_ms: float | None
    events_dropped: int | None  # during the paced run (None: no proxy)
    errors: int
    cpu_us_per_request: dict[str, float] = field(default_factory=dict)  # saturating
    cpu_us_per_request_half: dict[str, float] = field(default_factory=dict)


@dataclass
class Bench:
    """The benchmark's processes, all started and stopped by ``laswrr up``'s ``Stack``
    (services/up.py: the one way the stack starts, in its order, and stops, in its order):
    NATS, scheduler, recorder and proxies as ``laswrr up`` starts them, the instant engines and
    vllm-router as its other children. ``workdir`` holds the load generator's files; the stack's
    data directory (JetStream store, recorded log, ``logs/<name>.log``) is ``workdir/data``."""

    stack: Stack
    workdir: Path

    def pids(self, *names: str) -> dict[str, int]:
        return {child.name: child.pid for child in self.stack.children if child.name in names}

    def signal(self, names: tuple[str, ...], sig: signal.Signals) -> None:
        for child in self.stack.children:
            if child.name in names and child.process.returncode is None:
                child.process.send_signal(sig)

    async def stop(self) -> None:
        """Resume anything paused (SIGSTOP), then ``Stack.stop``: proxies and vllm-router,
        engines, scheduler, recorder (so it records everything), NATS."""
        self.signal(tuple(child.name for child in self.stack.children), signal.SIGCONT)
        await self.stack.stop()


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux /proc)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            with contextlib.suppress(OSError, ValueError):
                todo.extend(int(child) for child in task.read_text().split())
    return found


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its descendants (Linux /proc), 0 when unavailable."""
    total = 0.0
    for member in tree(pid):
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def quiesce(pids: dict[str, int], timeout: float = 30.0) -> None:
    """Wait until the stack has caught up (its processes use < 5 % CPU), so runs do not overlap."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = sum(cpu_seconds(p) for p in pids.values())
        time.sleep(0.5)
        if sum(cpu_seconds(p) for p in pids.values()) - before < 0.025 * max(1, len(pids)):
            return


def laswrr(*args: str) -> list[str]:
    return [sys.executable, "-m", "laswrr", *args]


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 2.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.loads(resp.read())


def proxy_figures(metrics_url: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One scrape of a proxy process's ``/metrics`` over the whole benchmark: its
    ``laswrr_proxy_event_batch_size`` histogram (batches, events, events per batch, and the
    batches at or below each bound), and what it sent on the channel between proxies against its
    request events (``bench.runner.channel_traffic``; None when it does not share)."""
    from prometheus_client.parser import text_string_to_metric_families

    from laswrr.bench.runner import channel_traffic
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        families = list(text_string_to_metric_families(resp.read().decode()))
    found: dict[str, Any] = {"batches": 0, "events": 0, "cumulative": {}}
    for family in families:
        for sample in family.samples if family.name == "laswrr_proxy_event_batch_size" else ():
            if sample.name.endswith("_count"):
                found["batches"] = int(sample.value)
            elif sample.name.endswith("_sum"):
                found["events"] = int(sample.value)
            elif sample.name.endswith("_bucket"):
                found["cumulative"][sample.labels["le"]] = int(sample.value)
    found["events_per_batch"] = round(found["events"] / found["batches"], 2) if found["batches"] else None
    return found, channel_traffic(families)


def events_dropped(metrics_urls: list[str]) -> int:
    """``laswrr_proxy_events_dropped_total`` summed over the proxies' /metrics."""
    total = 0.0
    for url in metrics_urls:
        with urllib.request.urlopen(url, timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("laswrr_proxy_events_dropped_total"):
                    total += float(line.rsplit(" ", 1)[1])
    return int(total)


def wait_until(check: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


async def start_vllm_router(bench: Bench, engines: list[str]) -> tuple[str | None, str]:
    binary = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    if not Path(binary).exists():
        return None, "vllm-router not installed (pip install 'laswrr[peers]' or pip install vllm-router)"
    from laswrr.services.nats_server import free_port
    port = free_port()
    child = await bench.stack.spawn("vllm-router", "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                                    *engines, "--policy", "round_robin", "--log-level", "warning", role="proxy",
                                    program=(binary,))
    url = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(wait_until, lambda: http_json(url + "/v1/chat/completions", CHAT_BODY)["choices"],
                                "vllm-router", 90)
    except TimeoutError:
        return None, f"vllm-router did not answer within 90 s; see {child.log_path}"
    return url, "ok"


@dataclass
class Target:
    name: str
    url: str
    cpu_of: dict[str, int]  # processes whose CPU time this target's requests cost
    paused: tuple[str, ...] = ()  # processes stopped (SIGSTOP) while this target runs
    metrics: list[str] = field(default_factory=list)  # the proxies' /metrics (events dropped)


def cpu_per_request(before: dict[str, float], after: dict[str, float], requests: int) -> dict[str, float]:
    return {name: round(1e6 * (after[name] - before[name]) / max(1, requests), 1) for name in before}


def measure(target: Target, bench: Bench, args: argparse.Namespace, direct_url: str) -> Result:
    url, workdir = target.url + "/v1/chat/completions", bench.workdir
    direct = direct_url + "/v1/chat/completions"
    bench.signal(target.paused, signal.SIGSTOP)
    try:
        load(url, CHAT_BODY, args.connections, 1.0, workdir)  # warm-up: connections, caches
        before = {name: cpu_seconds(pid) for name, pid in target.cpu_of.items()}
        throughput = load(url, CHAT_BODY, args.connections, args.duration, workdir)
        if not target.paused:
            quiesce(target.cpu_of)  # the consumers' work for these requests counts too
        after = {name: cpu_seconds(pid) for name, pid in target.cpu_of.items()}
        paced: dict[str, Any] = {}
        if url != direct:
            dropped_before = events_dropped(target.metrics) if target.metrics else None
            half_before = {name: cpu_seconds(pid) for name, pid in target.cpu_of.items()}
            half = paced_load(url, throughput["rps"] / 2, args.latency_duration, workdir)
            if not target.paused:
                quiesce(target.cpu_of)
            half_after = {name: cpu_seconds(pid) for name, pid in target.cpu_of.items()}
            dropped = events_dropped(target.metrics) - dropped_before if dropped_before is not None else None
            floor = paced_load(direct, half["rps"] / 2, args.latency_duration, workdir)
            paced = {"half_rps": round(half["rps"], 1), "p50_ms": round(half["p50_ms"], 3),
                     "p99_ms": round(half["p99_ms"], 3), "direct_p50_ms": round(floor["p50_ms"], 3),
                     "direct_p99_ms": round(floor["p99_ms"], 3), "added_p50_ms": round(half["p50_ms"] - floor["p50_ms"], 3),
                     "added_p99_ms": round(half["p99_ms"] - floor["p99_ms"], 3), "events_dropped": dropped,
                     "cpu_us_per_request_half": cpu_per_request(half_before, half_after, half["requests"])}
        streamed = load(url, STREAM_BODY, args.connections, args.duration, workdir)
    finally:
        bench.signal(target.paused, signal.SIGCONT)
    return Result(target=target.name, rps=round(throughput["rps"], 1), rps_stream=round(streamed["rps"], 1),
                  errors=throughput["errors"] + streamed["errors"] + (half["errors"] if paced else 0),
                  cpu_us_per_request=cpu_per_request(before, after, throughput["requests"]),
                  **({key: None for key in PACED} | paced))


PACED = ("half_rps", "p50_ms", "p99_ms", "direct_p50_ms", "direct_p99_ms", "added_p50_ms", "added_p99_ms",
         "events_dropped")


def best(runs: list[Result]) -> Result:
    """Of several rounds, the least disturbed: req/s and CPU from the round with the highest
    req/s; latency (and its floor, dropped events, CPU at half rate) from the lowest added P50."""
    top = max(runs, key=lambda r: r.rps)
    quiet = min(runs, key=lambda r: r.added_p50_ms or 0.0)
    paced = {key: getattr(quiet, key) for key in PACED}
    if quiet.events_dropped is not None:
        paced["events_dropped"] = sum(r.events_dropped or 0 for r in runs)
    return Result(target=top.target, rps=top.rps, rps_stream=max(r.rps_stream for r in runs),
                  errors=sum(r.errors for r in runs), cpu_us_per_request=top.cpu_us_per_request,
                  cpu_us_per_request_half=quiet.cpu_us_per_request_half, **paced)


def show(result: Result) -> None:
    cpu = " ".join(f"{k}={v:.0f}" for k, v in result.cpu_us_per_request.items())
    dropped = "-" if result.events_dropped is None else str(result.events_dropped)
    half = f"{'(the floor)':<98}" if result.half_rps is None else (
        f"at {result.half_rps:7.1f} req/s: p50 {result.p50_ms:6.3f} p99 {result.p99_ms:6.3f} ms, added p50 "
        f"{result.added_p50_ms:6.3f} p99 {result.added_p99_ms:6.3f} ms, dropped {dropped}")
    print(f"  {result.target:<20} {result.rps:8.1f} req/s {result.rps_stream:8.1f} SSE | {half} | "
          f"errors {result.errors} | cpu us/req: {cpu}", flush=True)


PROXIES = ("proxy-w1", "proxy-w2")


async def start_stack(bench: Bench, policy: str) -> tuple[dict[str, str], dict[str, str], dict[str, list[str]]]:
    """Engines, then ``laswrr up``'s order (services/up.py ``Stack``): NATS, scheduler and
    recorder, the engines registered (``lb.admin.node.<id>``, waiting until LB_WEIGHTS shows
    them), the two proxies; their URLs and /metrics URLs."""
    stack = bench.stack
    started = await asyncio.gather(*(stack.spawn(f"engine-{i}", "engine", role="sim-engine", wait_listening=True,
                                                 program=(sys.executable, "-m", "laswrr.bench.proxy_bench"))
                                     for i in (1, 2)))
    engines = {f"e{i}": child.url or "" for i, child in zip((1, 2), started)}
    nodes = [Node(id=node, url=url, capacity=64) for node, url in engines.items()]
    stack.allow_hosts(nodes)
    await stack.start_nats()
    await stack.start_core()
    await stack.register(nodes)
    proxies: dict[str, str] = {}
    metrics: dict[str, list[str]] = {}
    for name, workers in zip(PROXIES, (1, 2)):
        admin = free_ports(workers)
        proxies[name] = await stack.start_proxy(port=0, extra_args=("--policy", policy, "--workers", str(workers)),
                                                name=name, admin_port=admin)
        metrics[name] = [f"http://127.0.0.1:{admin + k}/metrics" for k in range(workers)]
        for url in metrics[name]:  # every worker routes on both engines
            await asyncio.to_thread(wait_until, lambda: len(http_json(url.replace("/metrics", "/healthz"))["pools"]
                                                            ["default"]["routable"]) == 2, f"{name} routes")
    return engines, proxies, metrics


def replay_exact(db: Path) -> dict[str, Any]:
    """``laswrr replay --db`` on the recorded log, as an operator runs it (NATS_URL at a closed
    port: the stack is stopped, the file is not locked)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "LASWRR_"))}
    env["NATS_URL"] = "nats://127.0.0.1:1"
    started = time.monotonic()
    proc = subprocess.run(laswrr("replay", "--db", str(db)), capture_output=True, text=True, env=env)
    lines = proc.stdout.splitlines()
    return {"exit": proc.returncode, "exact": proc.returncode == 0 and IDENTICAL in proc.stdout,
            "summary": lines[0] if lines else proc.stderr.strip()[-500:], "seconds": round(time.monotonic() - started, 1)}


IDENTICAL = "identical: every recorded output was reproduced byte for byte"


def run(args: argparse.Namespace) -> int:
    return asyncio.run(run_stack(args))


async def run_stack(args: argparse.Namespace) -> int:
    """The benchmark; the stack's children are watched by this event loop, so every blocking
    step (load runs, waits, HTTP probes) runs in a thread."""
    generator = ensure_wrk()
    workdir = Path(tempfile.mkdtemp(prefix="proxy-bench-"))
    bench = Bench(Stack(workdir / "data", proxy_port=0, secure=False), workdir)
    results: list[Result] = []
    notes: dict[str, Any] = {"load_generator": generator, "cpus": os.cpu_count(), "connections": args.connections,
                             "duration_s": args.duration, "latency_duration_s": args.latency_duration,
                             "rounds": args.rounds, "workdir": str(workdir), "load_average_start": os.getloadavg(),
                             "peer_interval_ms": os.environ.get("LASWRR_PEER_INTERVAL_MS")}
    started = time.monotonic()
    try:
        engines, proxies, metrics = await start_stack(bench, args.policy)
        router_url, router_status = await start_vllm_router(bench, list(engine for engine in engines.values()))
        notes["vllm_router"] = router_status
        engine_pids = bench.pids("engine-1", "engine-2")
        assert bench.stack.embedded is not None and bench.stack.embedded.process is not None
        bus_pids = {**bench.pids("scheduler", "recorder"), "nats": bench.stack.embedded.process.pid}
        stack_pids = {**bench.pids(*PROXIES), **bus_pids}
        targets = [Target("direct", engines["e1"], bench.pids("engine-1"))]
        for name, label in zip(PROXIES, ("laswrr-w1", "laswrr-w2")):
            cpu_of = {"proxy": bench.pids(name)[name], **bus_pids, **engine_pids}
            targets.append(Target(label, proxies[name], cpu_of, metrics=metrics[name]))
        targets.append(Target("laswrr-w1-proxy-only", proxies["proxy-w1"], targets[1].cpu_of,
                              paused=("scheduler", "recorder"), metrics=metrics["proxy-w1"]))
        if router_url is not None:
            targets.append(Target("vllm-router", router_url, {**bench.pids("vllm-router"), **engine_pids}))
        else:
            print(f"  vllm-router skipped: {router_status}")
        print(f"proxy benchmark ({generator}, {args.connections} connections, {args.duration:g} s per saturating run, "
              f"{args.latency_duration:g} s at half rate, {args.rounds} rounds, {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.2f})", flush=True)
        runs: dict[str, list[Result]] = {t.name: [] for t in targets}
        for round_no in range(args.rounds):
            for target in targets:  # interleaved, so a burst of outside load hits every target alike
                await asyncio.to_thread(quiesce, stack_pids)
                result = await asyncio.to_thread(measure, target, bench, args, engines["e1"])
                runs[target.name].append(result)
                print(f"round {round_no + 1}:", end="")
                show(result)
        results = [best(r) for r in runs.values()]
        notes["proxy_health"] = await asyncio.to_thread(http_json, metrics["proxy-w1"][0].replace("/metrics", "/healthz"))
        figures = {name: [await asyncio.to_thread(proxy_figures, url) for url in urls] for name, urls in metrics.items()}
        notes["event_batches"] = {name: [batches for batches, _ in found] for name, found in figures.items()}
        notes["channel"] = {name: [channel for _, channel in found] for name, found in figures.items()}
    finally:
        notes["load_average_end"] = os.getloadavg()
        await bench.stop()
    notes["replay"] = await asyncio.to_thread(replay_exact, bench.stack.data_dir / "events.duckdb")
    notes["wall_s"] = round(time.monotonic() - started, 1)
    print("best of rounds:")
    for result in results:
        show(result)
    report = summarize(results)
    replay = notes["replay"]
    print(f"  replay of the benchmark's log: {'exact' if replay['exact'] else 'NOT EXACT'} ({replay['summary']}; "
          f"{replay['seconds']:g} s)")
    for name, channels in notes.get("channel", {}).items():
        for i, channel in enumerate(channels):
            if channel is not None and channel["events"]:  # a request is two events: started, finished
                print(f"  channel between proxies, {name}[{i}]: {channel['messages']} messages sent "
                      f"({channel['messages'] / (channel['events'] / 2):.2f} a request), "
                      f"{channel['share_of_event_bytes']:.1%} of its request events' bytes")
    print(f"  wall time {notes['wall_s']:g} s, load average {notes['load_average_start'][0]:.2f} -> "
          f"{notes['load_average_end'][0]:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"results": [asdict(r) for r in results], **report, "notes": notes}, indent=2))
        print(f"wrote {args.out}")
    return 0 if replay["exact"] else 1


ADDED_P50_GOAL_MS, ADDED_P99_GOAL_MS = 0.5, 2.0


def summarize(results: list[Result]) -> dict[str, Any]:
    by = {r.target: r for r in results}
    report: dict[str, Any] = {}
    for name in ("laswrr-w1", "laswrr-w2"):
        if name not in by:
            continue
        ours = by[name]
        report[f"{name}_added_p50_ms"] = ours.added_p50_ms
        report[f"{name}_added_p99_ms"] = ours.added_p99_ms
        report[f"{name}_goal_added_p50_le_0.5ms_p99_le_2ms"] = (ours.added_p50_ms <= ADDED_P50_GOAL_MS
                                                                 and ours.added_p99_ms <= ADDED_P99_GOAL_MS)
        report[f"{name}_cpu_us_per_request"] = round(sum(ours.cpu_us_per_request.values()), 1)
        if "vllm-router" in by:
            peer = by["vllm-router"]
            report[f"{name}_rps_ratio_vs_vllm_router"] = round(ours.rps / peer.rps, 3)
            report[f"{name}_rps_ratio_vs_vllm_router_sse"] = round(ours.rps_stream / peer.rps_stream, 3)
            ours_cpu, peer_cpu = sum(ours.cpu_us_per_request.values()), sum(peer.cpu_us_per_request.values())
            if ours_cpu > 0:
                report[f"{name}_cpu_bound_ratio_vs_vllm_router"] = round(peer_cpu / ours_cpu, 3)
    if "vllm-router" in by:
        report["vllm_router_cpu_us_per_request"] = round(sum(by["vllm-router"].cpu_us_per_request.values()), 1)
        if "laswrr-w1-proxy-only" in by:
            report["rps_ratio_proxy_only_vs_vllm_router"] = round(by["laswrr-w1-proxy-only"].rps / by["vllm-router"].rps, 3)
    for key, value in report.items():
        print(f"  {key}: {value}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m laswrr.bench.proxy_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    engine = sub.add_parser("engine", help="run one instant engine")
    engine.add_argument("--host", default="127.0.0.1")
    engine.add_argument("--port", type=int, default=0)
    gen = sub.add_parser("load", help="the fallback load generator (prints one JSON line)")
    gen.add_argument("--url", required=True)
    gen.add_argument("--body", required=True)
    gen.add_argument("-c", "--connections", type=int, default=64)
    gen.add_argument("-d", "--duration", type=float, default=5.0)
    gen.add_argument("--pause-ms", type=int, default=0, help="each connection's pause after every answer")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per saturating run (default 6)")
    parser.add_argument("--latency-duration", type=float, default=4.0,
                        help="seconds of the run at half the saturating rate (default 4)")
    parser.add_argument("--connections", type=int, default=64, help="concurrent connections (default 64)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best is kept (default 2)")
    parser.add_argument("--policy", default="la-swrr", help="the proxy's pick policy (default la-swrr)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/proxy_bench.json"), help="JSON results file")
    args = parser.parse_args(argv)
    if args.command == "engine":
        asyncio.run(serve_engine(args.host, args.port))
        return 0
    if args.command == "load":
        print(json.dumps(asyncio.run(python_load(args.url, args.body.encode(), args.connections, args.duration,
                                                 args.pause_ms))))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
