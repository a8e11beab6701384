"""Proxy overhead benchmark: requests/s and added latency, direct vs our stack vs vllm-router.

    python -m laswrr.bench.proxy_bench [--duration 8] [--connections 64] [--rounds 2] [--out bench-out/proxy_bench.json]

One run starts, as separate processes on this machine: an embedded nats-server, two instant
engines (below), the real stack (``laswrr scheduler``, ``laswrr recorder``, ``laswrr proxy``;
nodes registered with ``lb.admin.node.<id>`` as an operator would) and, when installed,
``vllm-router`` (PyPI ``vllm-router``, the project's optional ``peers`` extra) on the same two
engines. Then, for each target:

* **latency**: one connection, sequential requests for ``--latency-duration`` s; the median
  and P99 of the client-measured time. Added latency = target median - direct median.
* **throughput**: ``--connections`` keep-alive connections for ``--duration`` s; requests/s.

Targets: ``direct`` (one engine, no router: the floor), ``laswrr`` (proxy + event publishing to
JetStream + scheduler + recorder, all running), ``laswrr-proxy-only`` (the same proxy, still
publishing every event to JetStream, with scheduler and recorder paused by SIGSTOP: what the
proxy alone costs), ``vllm-router`` (``--policy round_robin``). Non-streamed requests, plus a
streamed (SSE) throughput run per target. Targets run interleaved for ``--rounds`` rounds (the
machine may be shared; the best round is kept), each after the stack went idle.

CPU per request: the utime+stime each process spent during the throughput run (for ``laswrr``
until the scheduler and recorder caught up) divided by the requests served. Unlike requests/s,
this does not depend on what else runs on the machine, and shows where the time goes. When the
machine's cores are the bottleneck (as on a 2-core box), requests/s of a target tends to
cores / its total CPU per request, so ``cpu_bound_ratio_vs_vllm_router`` (vllm-router's total
CPU per request over ours, engines included in both, the load generator in neither) is the
ratio the measured one approaches on a busy machine.

The load generator is ``wrk`` (C, one thread) when installed (``apt-get install wrk``), else a
lean asyncio client in its own process (``python -m laswrr.bench.proxy_bench load``). The engine is a
raw asyncio HTTP/1.1 server answering at once with a fixed completion (JSON, or SSE when the
body asks for ``"stream": true``), so neither is the bottleneck.
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

from laswrr.services import settings

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
                      errors: list[int]) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            writer.write(request)
            status = await _read_response(reader)
            latencies.append(time.perf_counter() - t0)
            if status >= 400:
                errors.append(status)
    finally:
        writer.close()


async def python_load(url: str, body: bytes, connections: int, duration: float) -> dict[str, Any]:
    host, port, request = _request_bytes(url, body)
    latencies: list[float] = []
    errors: list[int] = []
    start = time.perf_counter()
    await asyncio.gather(*(_connection(host, port, request, start + duration, latencies, errors)
                           for _ in range(connections)))
    elapsed = time.perf_counter() - start
    return _summary(len(latencies), elapsed, len(errors), sorted(latencies))


def _summary(requests: int, elapsed: float, errors: int, ordered: list[float]) -> dict[str, Any]:
    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000 if ordered else float("nan")
    return {"requests": requests, "rps": requests / elapsed, "errors": errors,
            "p50_ms": pct(0.5), "p90_ms": pct(0.9), "p99_ms": pct(0.99)}


# -- wrk ------------------------------------------------------------------------------------------

WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = %s
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("WRKJSON {\\"requests\\": %%d, \\"duration_us\\": %%d, \\"errors\\": %%d, \\"non2xx\\": %%d, " ..
    "\\"p50_us\\": %%d, \\"p90_us\\": %%d, \\"p99_us\\": %%d}\\n", summary.requests, summary.duration,
    e.connect + e.read + e.write + e.timeout, e.status, latency:percentile(50), latency:percentile(90),
    latency:percentile(99)))
end
"""


def wrk_load(url: str, body: bytes, connections: int, duration: float, workdir: Path) -> dict[str, Any]:
    script = workdir / f"wrk-{abs(hash(body))}.lua"
    script.write_text(WRK_SCRIPT % json.dumps(body.decode()))
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "--timeout", "10s",
                          "-s", str(script), url], capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("WRKJSON "))
    data = json.loads(line[len("WRKJSON "):])
    seconds = data["duration_us"] / 1e6
    return {"requests": data["requests"], "rps": data["requests"] / seconds, "errors": data["errors"] + data["non2xx"],
            "p50_ms": data["p50_us"] / 1000, "p90_ms": data["p90_us"] / 1000, "p99_ms": data["p99_us"] / 1000}


def load(url: str, body: dict[str, Any], connections: int, duration: float, workdir: Path) -> dict[str, Any]:
    payload = json.dumps(body).encode()
    if shutil.which("wrk"):
        return wrk_load(url, payload, connections, duration, workdir)
    out = subprocess.run([sys.executable, "-m", "laswrr.bench.proxy_bench", "load", "--url", url, "--body", payload.decode(),
                          "-c", str(connections), "-d", str(duration)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- the stack ------------------------------------------------------------------------------------

@dataclass
class Result:
    target: str
    latency_p50_ms: float
    latency_p99_ms: float
    added_p50_ms: float
    rps: float
    rps_stream: float
    errors: int
    cpu_us_per_request: dict[str, float] = field(default_factory=dict)


class Stack:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.processes: list[tuple[str, subprocess.Popen[str]]] = []

    def spawn(self, name: str, argv: list[str], wait_line: str | None = None, timeout: float = 60.0) -> str:
        log = open(self.workdir / f"{name}.log", "w")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE if wait_line else log, stderr=log, text=True,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.processes.append((name, proc))
        if wait_line is None:
            return ""
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{name} exited early; see {self.workdir / (name + '.log')}")
            if wait_line in line:
                return line.strip().split()[-1]
        raise TimeoutError(f"{name} did not start")

    def pids(self, *names: str) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.processes if name in names}

    def signal(self, names: tuple[str, ...], sig: signal.Signals) -> None:
        for name, proc in self.processes:
            if name in names and proc.poll() is None:
                proc.send_signal(sig)

    def stop(self) -> None:
        self.signal(tuple(name for name, _ in self.processes), signal.SIGCONT)
        for name, proc in reversed(self.processes):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in reversed(self.processes):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc), 0 when unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


def wait_until(check: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


async def register_nodes(nats_url: str, engines: dict[str, str]) -> None:
    from laswrr.services.natsbus import connect, ensure_streams
    nc = await connect(nats_url, "proxy-bench")
    js = nc.jetstream()
    await ensure_streams(js)
    for node, url in engines.items():
        await js.publish(f"lb.admin.node.{node}", json.dumps({"url": url, "capacity": 64}).encode())
    await nc.drain()


def start_vllm_router(stack: Stack, engines: list[str]) -> tuple[str | None, str]:
    binary = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    if not Path(binary).exists():
        return None, "vllm-router not installed (pip install 'laswrr[peers]' or pip install vllm-router)"
    from laswrr.services.natsbus import free_port
    port = free_port()
    stack.spawn("vllm-router", [binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *engines,
                                "--policy", "round_robin", "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_json(url + "/v1/chat/completions", CHAT_BODY)["choices"], "vllm-router", 90)
    except TimeoutError:
        return None, f"vllm-router did not answer within 90 s; see {stack.workdir / 'vllm-router.log'}"
    return url, "ok"


@dataclass
class Target:
    name: str
    url: str
    cpu_of: dict[str, int]  # processes whose CPU time this target's requests cost
    paused: tuple[str, ...] = ()  # processes stopped (SIGSTOP) while this target runs


def measure(target: Target, stack: Stack, args: argparse.Namespace, direct_p50: float | None) -> Result:
    url, workdir = target.url + "/v1/chat/completions", stack.workdir
    stack.signal(target.paused, signal.SIGSTOP)
    try:
        load(url, CHAT_BODY, args.connections, 1.0, workdir)  # warm-up: connections, caches
        latency = load(url, CHAT_BODY, 1, args.latency_duration, workdir)
        before = {name: cpu_seconds(pid) for name, pid in target.cpu_of.items()}
        throughput = load(url, CHAT_BODY, args.connections, args.duration, workdir)
        if not target.paused:
            quiesce(target.cpu_of)  # the consumers' work for these requests counts too
        after = {name: cpu_seconds(pid) for name, pid in target.cpu_of.items()}
        streamed = load(url, STREAM_BODY, args.connections, args.duration, workdir)
    finally:
        stack.signal(target.paused, signal.SIGCONT)
    cpu = {name: round(1e6 * (after[name] - before[name]) / max(1, throughput["requests"]), 1) for name in before}
    added = latency["p50_ms"] - direct_p50 if direct_p50 is not None else 0.0
    return Result(target=target.name, latency_p50_ms=round(latency["p50_ms"], 3),
                  latency_p99_ms=round(latency["p99_ms"], 3), added_p50_ms=round(added, 3),
                  rps=round(throughput["rps"], 1), rps_stream=round(streamed["rps"], 1),
                  errors=latency["errors"] + throughput["errors"] + streamed["errors"], cpu_us_per_request=cpu)


def best(runs: list[Result]) -> Result:
    """Of several rounds, the least disturbed: highest req/s; latency from the round with the lowest P50."""
    top = max(runs, key=lambda r: r.rps)
    quiet = min(runs, key=lambda r: r.latency_p50_ms)
    return Result(target=top.target, latency_p50_ms=quiet.latency_p50_ms, latency_p99_ms=quiet.latency_p99_ms,
                  added_p50_ms=quiet.added_p50_ms, rps=top.rps, rps_stream=max(r.rps_stream for r in runs),
                  errors=sum(r.errors for r in runs), cpu_us_per_request=top.cpu_us_per_request)


def show(result: Result) -> None:
    cpu = " ".join(f"{k}={v:.0f}" for k, v in result.cpu_us_per_request.items())
    print(f"  {result.target:<17} p50 {result.latency_p50_ms:7.3f} ms  p99 {result.latency_p99_ms:7.3f} ms  "
          f"added {result.added_p50_ms:6.3f} ms  {result.rps:8.1f} req/s  {result.rps_stream:8.1f} req/s SSE  "
          f"errors {result.errors}  cpu us/req: {cpu}", flush=True)


def start_stack(stack: Stack, nats_url: str, policy: str) -> tuple[dict[str, str], str]:
    engines = {f"e{i}": stack.spawn(f"engine-{i}", [sys.executable, "-m", "laswrr.bench.proxy_bench", "engine"], LISTEN)
               for i in (1, 2)}
    stack.spawn("scheduler", laswrr("scheduler", "--nats-url", nats_url))
    stack.spawn("recorder", laswrr("recorder", "--nats-url", nats_url, "--data-dir", str(stack.workdir / "data")))
    asyncio.run(register_nodes(nats_url, engines))
    proxy = stack.spawn("proxy", laswrr("proxy", "--nats-url", nats_url, "--host", "127.0.0.1", "--port", "0",
                                        "--proxy-id", "bench", "--policy", policy), LISTEN)
    wait_until(lambda: len(http_json(proxy + "/healthz")["pools"]["default"]["routable"]) == 2, "proxy routes")
    return engines, proxy


def run(args: argparse.Namespace) -> int:
    from laswrr.services.natsbus import EmbeddedNats
    workdir = Path(tempfile.mkdtemp(prefix="proxy-bench-"))
    stack = Stack(workdir)
    nats = EmbeddedNats(workdir / "nats").start()
    results: list[Result] = []
    notes: dict[str, Any] = {"load_generator": "wrk" if shutil.which("wrk") else "python", "cpus": os.cpu_count(),
                             "connections": args.connections, "duration_s": args.duration, "rounds": args.rounds,
                             "workdir": str(workdir)}
    try:
        engines, proxy = start_stack(stack, nats.url, args.policy)
        router_url, router_status = start_vllm_router(stack, list(engines.values()))
        notes["vllm_router"] = router_status
        engine_pids = stack.pids("engine-1", "engine-2")
        stack_pids = {**stack.pids("proxy", "scheduler", "recorder"), "nats": nats.process.pid}  # type: ignore[union-attr]
        targets = [Target("direct", engines["e1"], stack.pids("engine-1")),
                   Target("laswrr", proxy, {**stack_pids, **engine_pids}),
                   Target("laswrr-proxy-only", proxy, {**stack_pids, **engine_pids}, paused=("scheduler", "recorder"))]
        if router_url is not None:
            targets.append(Target("vllm-router", router_url, {**stack.pids("vllm-router"), **engine_pids}))
        else:
            print(f"  vllm-router skipped: {router_status}")
        print(f"proxy benchmark ({notes['load_generator']}, {args.connections} connections, {args.duration:g} s "
              f"per run, {args.rounds} rounds, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f})", flush=True)
        runs: dict[str, list[Result]] = {t.name: [] for t in targets}
        direct_p50: float | None = None
        for round_no in range(args.rounds):
            for target in targets:  # interleaved, so a burst of outside load hits every target alike
                quiesce(stack_pids)
                result = measure(target, stack, args, direct_p50 if target.name != "direct" else None)
                if target.name == "direct":
                    direct_p50 = min(direct_p50 or result.latency_p50_ms, result.latency_p50_ms)
                runs[target.name].append(result)
                print(f"round {round_no + 1}:", end="")
                show(result)
        results = [best(r) for r in runs.values()]
        notes["proxy_health"] = http_json(proxy + "/healthz")
    finally:
        stack.stop()
        nats.stop()
    print("best of rounds:")
    for result in results:
        show(result)
    report = summarize(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"results": [asdict(r) for r in results], **report, "notes": notes}, indent=2))
        print(f"wrote {args.out}")
    return 0


def summarize(results: list[Result]) -> dict[str, Any]:
    by = {r.target: r for r in results}
    report: dict[str, Any] = {}
    if "laswrr" in by:
        ours = by["laswrr"]
        report["added_latency_p50_ms"] = ours.added_p50_ms
        report["goal_added_latency_le_2ms"] = ours.added_p50_ms <= 2.0
        if "vllm-router" in by:
            peer = by["vllm-router"]
            report["rps_ratio_vs_vllm_router"] = round(ours.rps / peer.rps, 3)
            report["rps_ratio_vs_vllm_router_sse"] = round(ours.rps_stream / peer.rps_stream, 3)
            report["rps_ratio_proxy_only_vs_vllm_router"] = round(by["laswrr-proxy-only"].rps / peer.rps, 3)
            report["goal_rps_ge_0.6x_vllm_router"] = ours.rps / peer.rps >= 0.6
            ours_cpu, peer_cpu = sum(ours.cpu_us_per_request.values()), sum(peer.cpu_us_per_request.values())
            report["cpu_us_per_request_laswrr"] = round(ours_cpu, 1)
            report["cpu_us_per_request_vllm_router"] = round(peer_cpu, 1)
            if ours_cpu > 0:
                report["cpu_bound_ratio_vs_vllm_router"] = round(peer_cpu / ours_cpu, 3)
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
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per throughput run (default 8)")
    parser.add_argument("--latency-duration", type=float, default=4.0, help="seconds of the latency run (default 4)")
    parser.add_argument("--connections", type=int, default=64, help="concurrent connections (default 64)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best is kept (default 2)")
    parser.add_argument("--policy", default="la-swrr", help="the proxy's pick policy (default la-swrr)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/proxy_bench.json"), help="JSON results file")
    args = parser.parse_args(argv)
    if args.command == "engine":
        asyncio.run(serve_engine(args.host, args.port))
        return 0
    if args.command == "load":
        print(json.dumps(asyncio.run(python_load(args.url, args.body.encode(), args.connections, args.duration))))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
