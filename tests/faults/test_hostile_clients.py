"""Hostile HTTP clients against a real `laswrr up` proxy: a slowloris of 64 half-open sockets
while normal clients are served, and invalid UTF-8 in every field the proxy reads.

Real parts: `laswrr up` as a child process (embedded NATS, four simulated engines, API keys on)
with short ``--idle-timeout-s`` and ``--body-timeout-s`` (2 s, through their ``LASWRR_``
variables, which `laswrr up` hands to its proxy), raw sockets for what no HTTP library sends,
and eight real clients (``Load``) beside them. The proxy's open file descriptors and resident
memory are read from /proc by its pid. The last test stops the stack and checks the log: every
request answered 200 is recorded as completed, and ``laswrr replay --db`` on it is exact.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from laswrr.replay import store
from tests.replay_cli import replay_exact
from tests.up_process import Load

pytestmark = pytest.mark.timeout(180)
KEY = "k1-hostile-test-key"
TIMEOUT_S = 2.0  # the proxy's --idle-timeout-s and --body-timeout-s here
LINGER_S = 10.0  # aiohttp reads what is left of a refused body for up to this before it closes
HOSTILE = 64


@dataclass
class Stack:
    proc: subprocess.Popen[bytes]
    data: Path
    proxy: str  # http://host:port
    host: str
    port: int
    proxy_pid: int
    ok: int = 0  # requests of this module answered 200 (each must be recorded as completed)


def _banner(out: Path, proc: subprocess.Popen[bytes], timeout_s: float = 90.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = out.read_text() if out.exists() else ""
        if "Ctrl-C" in text:
            banner = {}
            for line in text.splitlines():
                key, _, value = line.strip().partition(": ")
                parts = line.split()
                if len(parts) >= 4 and parts[2] == "pid":
                    banner[f"pid {parts[1]}"] = parts[3]
                elif value:
                    banner[key] = value
            return banner
        assert proc.poll() is None, f"laswrr up exited: {(out.parent / 'up.err').read_text()[-2000:]}"
        time.sleep(0.1)
    raise AssertionError("no banner from laswrr up")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("hostile")
    keys = work / "keys.txt"
    keys.write_text(f"tester:{KEY}\n")
    env = {**os.environ, "LASWRR_IDLE_TIMEOUT_S": str(TIMEOUT_S), "LASWRR_BODY_TIMEOUT_S": str(TIMEOUT_S)}
    out, err = work / "up.out", work / "up.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "laswrr", "up", "--data-dir", str(work / "data"),
                                 "--proxy-port", "0", "--dashboard-port", "0", "--sim-speed", "20",
                                 "--api-keys", str(keys)], stdout=stdout, stderr=stderr, env=env,
                                start_new_session=True)
    try:
        banner = _banner(out, proc)
        proxy = banner["proxy URL"].split()[0]
        host, _, port = proxy.removeprefix("http://").rpartition(":")
        yield Stack(proc, work / "data", proxy, host, int(port), int(banner["pid proxy"]))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def hostile(kind: str, host: str, port: int) -> tuple[str, float, bytes]:
    """One half-open socket: ``head`` sends a request head byte by byte and never ends it,
    ``body`` sends a whole head announcing 100000 bytes and then its body byte by byte,
    ``silent`` connects and sends nothing. Each keeps going until the proxy closes the
    connection; returns how long that took and the first bytes the proxy answered."""
    reader, writer = await asyncio.open_connection(host, port)
    started = time.monotonic()
    if kind == "head":
        trickle = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100_000
    elif kind == "body":
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
        trickle = b" " * 100_000
    else:
        trickle = b""
    answer = b""
    try:
        for i in range(100_000):
            if trickle:
                writer.write(trickle[i:i + 1])
                await writer.drain()
            try:
                chunk = await asyncio.wait_for(reader.read(4096), 0.1)
            except asyncio.TimeoutError:
                continue
            if not chunk:
                break
            answer += chunk
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
    return kind, time.monotonic() - started, answer


async def test_a_slowloris_does_not_starve_normal_clients(stack: Stack, eventually: Callable[..., Awaitable[Any]]) -> None:
    pid = stack.proxy_pid
    base_fds, base_rss = fds(pid), rss_kib(pid)
    load = Load(stack.proxy, headers={"Authorization": f"Bearer {KEY}"})
    load.start()
    kinds = ["head"] * 24 + ["body"] * 20 + ["silent"] * 20
    assert len(kinds) == HOSTILE
    attack = asyncio.gather(*(hostile(kind, stack.host, stack.port) for kind in kinds))
    await eventually(lambda: fds(pid) >= base_fds + HOSTILE, timeout=30, what="the proxy holding the 64 sockets")
    peak_fds, peak_rss = fds(pid), rss_kib(pid)
    served_during = load.served
    results = await asyncio.wait_for(attack, TIMEOUT_S + LINGER_S + 30)
    served_during = load.served - served_during
    await load.stop()
    stack.ok += load.served
    await eventually(lambda: fds(pid) <= peak_fds - HOSTILE + 8, what="the proxy to release the 64 sockets")
    after_fds, after_rss = fds(pid), rss_kib(pid)
    closed = {kind: max(t for k, t, _ in results if k == kind) for kind in set(kinds)}
    answers = {kind: {a.split(b"\r\n", 1)[0].decode(errors="replace") for k, _, a in results if k == kind}
               for kind in set(kinds)}
    print(f"FAULT slowloris {HOSTILE} half-open sockets (24 heads and 20 bodies byte by byte, 20 silent) beside "
          f"{load.workers} clients: served {load.served} ({served_during} while the sockets were open) failed "
          f"{load.failed}; all closed by the proxy within {max(closed.values()):.1f} s (head {closed['head']:.1f}, "
          f"silent {closed['silent']:.1f}, body {closed['body']:.1f}: 408 then aiohttp's {LINGER_S:g} s linger); "
          f"proxy fds {base_fds} -> {peak_fds} -> {after_fds}, RSS {base_rss // 1024} -> {peak_rss // 1024} -> "
          f"{after_rss // 1024} MiB; answers {answers}")
    assert load.failed == 0 and load.served > 0, load.reasons
    assert served_during > 0  # served while the 64 sockets were held, not only after
    assert peak_fds >= base_fds + HOSTILE // 2  # the attack did hold sockets (this test can fail)
    assert closed["head"] < TIMEOUT_S + 5 and closed["silent"] < TIMEOUT_S + 5
    assert closed["body"] < TIMEOUT_S + LINGER_S + 5
    assert answers["body"] == {"HTTP/1.1 408 Request Timeout"}
    assert answers["silent"] == {""} and answers["head"] == {""}  # closed without a word
    assert after_fds <= peak_fds - HOSTILE + 8  # the 64 are gone (pooled upstream connections stay a while)
    assert peak_rss - base_rss < 64 * 1024 and after_rss - base_rss < 64 * 1024  # KiB: bounded


GOOD = json.dumps({"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).encode()


def raw_request(path: bytes = b"/v1/chat/completions", headers: bytes = b"", body: bytes = GOOD,
                auth: bytes = b"Bearer " + KEY.encode()) -> bytes:
    head = [b"POST " + path + b" HTTP/1.1", b"Host: x", b"Content-Type: application/json",
            b"Content-Length: " + str(len(body)).encode(), b"Connection: close"]
    if auth:
        head.append(b"Authorization: " + auth)
    return b"\r\n".join(head) + b"\r\n" + headers + b"\r\n" + body


def body_with(old: bytes, new: bytes) -> bytes:
    assert old in GOOD
    return GOOD.replace(old, new, 1)


# Each: the request, and whether the proxy reads the field (then a 4xx is required) or only
# passes it on to the engine as HTTP allows (then it is served, never a 5xx).
CASES: dict[str, tuple[bytes, bool]] = {
    "path": (raw_request(path=b"/v1/chat/compl\xff\xfeetions"), True),
    "query": (raw_request(path=b"/v1/chat/completions?x=\xff"), True),
    "path, percent-encoded": (raw_request(path=b"/v1/chat/completions%ff"), True),
    "header name": (raw_request(headers=b"X-\xffBad: 1\r\n"), True),
    "Authorization, bytes": (raw_request(auth=b"Bearer \xff\xfe"), True),
    "Authorization, Latin-1 key": (raw_request(auth=b"Bearer " + KEY.encode() + b"\xe9"), True),
    "Authorization, scheme": (raw_request(auth=b"Be\xffarer " + KEY.encode()), True),
    "body string": (raw_request(body=body_with(b'"hi"', b'"h\xffi"')), True),
    "body key": (raw_request(body=body_with(b'"max_tokens"', b'"max_\xfftokens"')), True),
    "body, unknown field": (raw_request(body=body_with(b'"max_tokens"', b'"user": "\xc3\x28", "max_tokens"')), True),
    "model": (raw_request(body=body_with(b'"default"', b'"def\xffault"')), True),
    "model, lone surrogate escape": (raw_request(body=body_with(b'"default"', b'"def\\udcffault"')), True),
    "content, lone surrogate escape": (raw_request(body=body_with(b'"hi"', b'"h\\ud800i"')), True),
    "header value": (raw_request(headers=b"X-Thing: caf\xe9\xff\r\n"), False),
    "X-Request-Id": (raw_request(headers=b"X-Request-Id: \xff\xfe\xfd\r\n"), False),
    "x-laswrr-request-id": (raw_request(headers=b"x-laswrr-request-id: \xff\r\n"), False),
    "Content-Type": (raw_request().replace(b"application/json", b"application/js\xffon"), False),
}


async def send_raw(stack: Stack, request: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(stack.host, stack.port)
    writer.write(request)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 30)  # Connection: close
    writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


async def test_invalid_utf8_in_every_field_is_a_clear_4xx(stack: Stack) -> None:
    outcomes = {}
    for name, (request, read_by_proxy) in CASES.items():
        status, body = await send_raw(stack, request)
        outcomes[name] = status
        if status == 200:
            stack.ok += 1
        assert status < 500, f"{name}: {status} {body[:300]!r}"
        if read_by_proxy:
            assert 400 <= status < 500 and body, f"{name}: {status} {body[:300]!r}"
    status, _ = await send_raw(stack, raw_request())
    assert status == 200  # and it goes on serving
    stack.ok += 1
    assert stack.proc.poll() is None and fds(stack.proxy_pid) > 0  # the same proxy process
    log = (stack.data / "logs" / "proxy.log").read_text()
    print(f"FAULT invalid UTF-8 in {len(CASES)} HTTP fields: {outcomes}; proxy log tracebacks "
          f"{log.count('Traceback')}")
    assert "Traceback" not in log  # refused requests are throttled one-line warnings, nothing crashed
    assert "refused malformed HTTP requests (400)" in log


def test_after_the_hostile_clients_the_log_is_complete_and_replays_exactly(stack: Stack) -> None:
    stack.proc.send_signal(signal.SIGINT)
    assert stack.proc.wait(90) == 0
    with store.open_read(stack.data / store.DB_FILE) as con:
        completed = con.execute("SELECT count(*) FROM requests WHERE outcome = 'completed'").fetchone()
        other = con.execute("SELECT count(*) FROM requests WHERE outcome IS DISTINCT FROM 'completed'").fetchone()
    summary = replay_exact(stack.data / store.DB_FILE)
    print(f"FAULT hostile clients, the log: {completed} completed requests for {stack.ok} answered 200; "
          f"replay: {summary}")
    assert completed == (stack.ok,) and other == (0,)
