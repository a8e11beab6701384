"""Container health checks for compose.yaml: standard library only, exit 0 = healthy, 1 = not.

Two checks, one line on stderr when unhealthy:

* ``healthcheck.py http URL`` — a GET answering 2xx (the proxy's ``/readiness``, an engine's
  ``/health``, the collector's ``/metrics``). The proxy's ``/readiness`` answers 200 only while
  it holds a snapshot with a routable node (503 and the reason before); its ``/health`` and
  ``/healthz`` are liveness: 200 while it serves, stale snapshot or not (a proxy never fails
  closed), 503 only while stopping.
* ``healthcheck.py nats-client NAME [--stream S ...]`` — the NATS server's monitoring endpoint
  (``$NATS_MONITOR_URL``, default ``http://nats:8222``) lists a client connection named NAME
  (``laswrr-scheduler-<replica-id>``, ``laswrr-recorder``) and, when asked, the JetStream
  streams S. A service without an HTTP port is healthy when its own process holds a live NATS
  connection: a hung or dead process loses it (the server's pings go unanswered).

* ``healthcheck.py auto`` — the image's own ``HEALTHCHECK`` (Dockerfile), for ``docker run``
  without compose: it reads the container's command (``/proc/1/cmdline``; ``--cmdline`` for
  tests) and probes what that service serves: ``laswrr proxy`` its ``/readiness``, ``laswrr
  sim-engine`` its ``/health``, ``laswrr collector --metrics-port N`` its ``/metrics``, on
  127.0.0.1 and the port of the command line (else ``LASWRR_PORT`` / ``LASWRR_METRICS_PORT``,
  else the default). A command without an HTTP port (scheduler, recorder, a one-shot) is healthy
  while it runs; compose.yaml gives those a NATS check instead.

The image copies this file to ``/app/deploy/healthcheck.py``; ``deploy/compose_local.py`` runs
the same checks against local processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

DEFAULT_MONITOR_URL = "http://nats:8222"


class Unhealthy(Exception):
    """The one-line reason a check failed."""


def fetch(url: str, timeout_s: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (operator URL)
            return bytes(response.read())
    except urllib.error.HTTPError as exc:
        raise Unhealthy(f"{url}: HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise Unhealthy(f"{url}: {reason}") from None


def fetch_json(url: str, timeout_s: float) -> Any:
    try:
        return json.loads(fetch(url, timeout_s))
    except ValueError:
        raise Unhealthy(f"{url}: not JSON") from None


def stream_names(jsz: Any) -> Iterator[str]:
    """Every ``stream_detail[].name`` in a ``/jsz?streams=true`` answer."""
    for account in jsz.get("account_details") or []:
        for stream in account.get("stream_detail") or []:
            if isinstance(stream, dict) and isinstance(stream.get("name"), str):
                yield stream["name"]


def check_nats_client(monitor_url: str, name: str, streams: Sequence[str], timeout_s: float) -> str:
    base = monitor_url.rstrip("/")
    connz = fetch_json(f"{base}/connz?limit=100000", timeout_s)
    names = {c.get("name") for c in connz.get("connections") or [] if isinstance(c, dict)}
    if name not in names:
        raise Unhealthy(f"no NATS connection named {name!r} on {base} ({len(names)} connection(s))")
    if streams:
        present = set(stream_names(fetch_json(f"{base}/jsz?streams=true", timeout_s)))
        missing = [s for s in streams if s not in present]
        if missing:
            raise Unhealthy(f"stream(s) {', '.join(missing)} missing on {base}")
    return f"{name} connected" + (f", streams {', '.join(streams)} present" if streams else "")


def check_http(url: str, timeout_s: float) -> str:
    fetch(url, timeout_s)
    return f"{url} answered"


# service -> (path probed, port flag, its LASWRR_ variable, default port); see ``auto``
AUTO_PROBES = {
    "proxy": ("/readiness", "--port", "LASWRR_PORT", 8000),
    "sim-engine": ("/health", "--port", "LASWRR_PORT", None),
    "collector": ("/metrics", "--metrics-port", "LASWRR_METRICS_PORT", None),
}


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def auto_probe(cmdline: Sequence[str], environ: Any = os.environ) -> str | None:
    """The URL to probe for the laswrr command in ``cmdline``; None when it serves no HTTP probe."""
    at = next((i for i, word in enumerate(cmdline) if os.path.basename(word) == "laswrr"), None)
    if at is None and len(cmdline) > 2 and cmdline[1:3] == ["-m", "laswrr"]:
        at = 2
    argv = list(cmdline[at + 1:]) if at is not None else []
    if not argv or argv[0] not in AUTO_PROBES:
        return None
    path, flag, variable, default = AUTO_PROBES[argv[0]]
    port = flag_value(argv, flag) or environ.get(variable) or default
    return None if port in (None, "0") else f"http://127.0.0.1:{port}{path}"


def check_auto(cmdline: Sequence[str], timeout_s: float) -> str:
    url = auto_probe(cmdline)
    if url is None:
        return f"{' '.join(cmdline) or 'the command'} serves no HTTP probe; running"
    return check_http(url, timeout_s)


def _pid1_cmdline() -> list[str]:
    with open("/proc/1/cmdline", "rb") as handle:
        return [part.decode(errors="replace") for part in handle.read().split(b"\0") if part]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="healthcheck.py", description="laswrr container health checks")
    parser.add_argument("--timeout-s", type=float, default=3.0, help="per request (default 3)")
    checks = parser.add_subparsers(dest="check", required=True)
    http = checks.add_parser("http", help="GET URL answers 2xx")
    http.add_argument("url")
    client = checks.add_parser("nats-client", help="a NATS connection named NAME exists")
    client.add_argument("name")
    client.add_argument("--stream", action="append", default=[], help="a JetStream stream that must exist")
    client.add_argument("--monitor-url", default=os.environ.get("NATS_MONITOR_URL") or DEFAULT_MONITOR_URL,
                        help=f"NATS monitoring base URL (default $NATS_MONITOR_URL or {DEFAULT_MONITOR_URL})")
    auto = checks.add_parser("auto", help="probe what the container's laswrr command serves")
    auto.add_argument("--cmdline", default=None, help="the command to look at (default: PID 1's)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.check == "http":
            message = check_http(args.url, args.timeout_s)
        elif args.check == "auto":
            cmdline = args.cmdline.split() if args.cmdline is not None else _pid1_cmdline()
            message = check_auto(cmdline, args.timeout_s)
        else:
            message = check_nats_client(args.monitor_url, args.name, args.stream, args.timeout_s)
    except Unhealthy as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    print(f"healthy: {message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
