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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.check == "http":
            message = check_http(args.url, args.timeout_s)
        else:
            message = check_nats_client(args.monitor_url, args.name, args.stream, args.timeout_s)
    except Unhealthy as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    print(f"healthy: {message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
