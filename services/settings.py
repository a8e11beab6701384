"""What every service command shares: its NATS options, its logging and its stop signal.

Rules:

* **NATS.** Every command that talks to NATS takes ``--nats-url`` (default: the ``NATS_URL``
  environment variable, else ``nats://127.0.0.1:4222``; a cluster's servers comma-separated)
  through ``add_nats_options``; the connection itself is ``natsbus.connect``, the only door to
  the bus. A service that creates missing streams takes ``--stream-replicas`` (``add_stream_replicas``).
* **Logging.** Every command takes ``--log-level LEVEL`` (any case: ``debug``, ``INFO``,
  ``Warning``, ...; ``-v`` is a deprecated alias for ``debug``) and ``--log-format text|json``
  through ``add_logging`` and calls ``configure_logging(args, service)`` once, first thing:
  records go to stderr as ``<time> <service> <LEVEL> <logger>: <message>`` (text), or as one
  JSON object per line (json: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``,
  ``service``, then the record's own fields: whatever was passed as ``extra=``, and
  ``exc_info`` with a traceback), written by python-json-logger.
* **Durations.** A flag whose name ends in ``-ms`` or ``-s`` (``--tick-ms``, ``--grace-s``),
  and ``--wait``, is a duration: a bare number is in the flag's unit, a number with a unit
  (``500ms``, ``2s``, ``1.5m``, ``1h``) is converted to it (``--grace-s 500ms`` is 0.5 s,
  ``--tick-ms 0.2s`` is 200 ms); a millisecond flag takes whole milliseconds. ``duration(unit)``
  is the argparse type.
* **Stopping.** ``stop_event()`` turns SIGINT and SIGTERM into an ``asyncio.Event`` the service
  awaits, so it can finish its batch, drain its NATS connection and exit 0.

Defaults of a service's own options live in its configuration dataclass (``ProxyConfig``,
``SchedulerOptions``, ``RecorderOptions``, ...) and its argparse defaults are read from there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
from collections.abc import Callable
from typing import Any

from laswrr.services.natsbus import AUTH_ENV, MAX_REPLICAS, NatsAuth, StreamLimits

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_DATA_DIR = ".laswrr"
DEFAULT_TICK_MS = 100
DEFAULT_PROXY_PORT = 8000
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")


def default_nats_url() -> str:
    return os.environ.get("NATS_URL") or DEFAULT_NATS_URL


def nats_hint(url: str) -> str:
    """What a command adds to its "cannot connect" error when it tried the built-in default URL:
    ``laswrr up`` runs NATS on a port of its own and writes its URL (with the operator's
    password) to ``<data-dir>/secrets/operator.env``; the file is named when it is in ./.laswrr."""
    if url != DEFAULT_NATS_URL or os.environ.get("NATS_URL"):
        return ""
    env = os.path.join(DEFAULT_DATA_DIR, "secrets", "operator.env")
    where = env if os.path.exists(env) else "<data-dir>/secrets/operator.env"
    return (f" (the default URL: `laswrr up` runs NATS on a port of its own and writes its URL to {where}: "
            f"export $(cat {where}), or give --nats-url)")


# -- NATS ---------------------------------------------------------------------------------------


def add_nats_options(parser: argparse.ArgumentParser, embedded: bool = False) -> None:
    """``--nats-url`` (user:password@ or token@ may be in it) and the credential files
    ``--nats-creds``, ``--nats-nkey``, ``--nats-tls-ca``, ``--nats-tls-cert``, ``--nats-tls-key``,
    each defaulting to its environment variable (``NATS_CREDS``, ...). ``embedded``: the command
    starts its own server unless a URL is given (``laswrr up``), so the URL's default is None."""
    group = parser.add_argument_group("NATS connection")
    if embedded:
        group.add_argument("--nats-url", default=None, metavar="URL",
                           help="use this NATS server, or a cluster's servers comma-separated (default: start "
                                "an embedded one)")
    else:
        group.add_argument("--nats-url", default=default_nats_url(), metavar="URL",
                           help=f"NATS server, or a cluster's servers comma-separated (failover); may hold "
                                f"user:password@ or token@ (default: $NATS_URL or {DEFAULT_NATS_URL})")
    for field, var in AUTH_ENV.items():
        flag = "--nats-" + field.replace("_", "-")
        group.add_argument(flag, dest=f"nats_{field}", default=os.environ.get(var) or None, metavar="FILE",
                           help=f"{_AUTH_HELP[field]} (default ${var})")


_AUTH_HELP = {"creds": "NATS decentralised-auth credentials (.creds)", "nkey": "file with an nkey seed",
              "tls_ca": "CA certificates that signed the server's", "tls_cert": "client certificate (mutual TLS)",
              "tls_key": "client certificate's private key"}


def nats_auth(args: argparse.Namespace) -> NatsAuth:
    """The credential files given by ``add_nats_options``' flags (or their environment variables)."""
    return NatsAuth(**{field: getattr(args, f"nats_{field}", None) for field in AUTH_ENV})


def replicas(text: str) -> int:
    """argparse type: a JetStream replica count, 1..5."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of replicas: {text!r}") from None
    if not 1 <= count <= MAX_REPLICAS:
        raise argparse.ArgumentTypeError(f"replicas must be in 1..{MAX_REPLICAS}, got {count}")
    return count


def add_stream_replicas(parser: argparse.ArgumentParser, default: int | None = StreamLimits.replicas,
                        help: str | None = None) -> None:
    """``--stream-replicas N``: the copies of each stream and bucket a service creates where
    missing (on a NATS cluster); one that exists keeps its own, with a warning."""
    parser.add_argument("--stream-replicas", type=replicas, default=default, metavar="N", help=help or (
        f"copies of LB_EVENTS, LB_OUT and the buckets when this service creates them, on a NATS cluster "
        f"(1..{MAX_REPLICAS}; default %(default)s; an existing stream keeps its own, with a warning)"))


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0..65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {port}")
    return port


def add_metrics_port(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics-port", type=port_number, default=None, metavar="PORT",
                        help="serve Prometheus /metrics on this port (default: none)")


# -- logging ------------------------------------------------------------------------------------


def log_level(text: str) -> str:
    """argparse type: a level name in any case -> its upper-case name."""
    level = text.strip().upper()
    if level == "WARN":
        level = "WARNING"
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"unknown log level {text!r}: use one of {', '.join(LOG_LEVELS).lower()}")
    return level


def add_logging(parser: argparse.ArgumentParser, default: str = "INFO") -> None:
    parser.add_argument("--log-level", type=log_level, default=log_level(default), metavar="LEVEL",
                        help=f"debug, info, warning, error or critical, any case (default {default.lower()})")
    parser.add_argument("-v", dest="log_level", action="store_const", const="DEBUG",
                        help="deprecated: same as --log-level debug")
    parser.add_argument("--log-format", type=str.lower, choices=LOG_FORMATS, default="text",
                        help="text lines, or one JSON object per line (default text)")


def configure_logging(args: argparse.Namespace | None, service: str) -> None:
    """The one logging set-up of every command (stderr; ``--log-level``, ``--log-format``)."""
    level = getattr(args, "log_level", None) or "INFO"
    handler = logging.StreamHandler()  # stderr
    if getattr(args, "log_format", "text") == "json":
        from pythonjsonlogger.json import JsonFormatter  # only json needs it

        handler.setFormatter(JsonFormatter("{levelname}{name}{message}", style="{", timestamp="time",
                                           rename_fields={"levelname": "level", "name": "logger"},
                                           static_fields={"service": service}))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    if level != "DEBUG":
        logging.getLogger("nats").setLevel(logging.WARNING)


# -- durations ----------------------------------------------------------------------------------

DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*", re.IGNORECASE)


def duration(unit: str) -> Callable[[str], Any]:
    """argparse type of a duration flag in ``unit`` ("s": float seconds, "ms": int milliseconds)."""
    scale = DURATION_UNITS[unit]

    def parse(text: str) -> float | int:
        match = _DURATION.fullmatch(text)
        if not match:
            raise argparse.ArgumentTypeError(f"invalid duration {text!r}: a number of {unit}, or with a unit "
                                             "(500ms, 2s, 1.5m, 1h)")
        given = DURATION_UNITS[(match.group(2) or unit).lower()]
        value = float(match.group(1)) * given / scale
        if unit != "ms":
            return value
        if abs(value - round(value)) > 1e-9:
            raise argparse.ArgumentTypeError(f"invalid duration {text!r}: whole milliseconds only")
        return int(round(value))

    parse.__name__ = f"duration_{unit}"  # argparse names the type in its error messages
    return parse


# -- stopping -----------------------------------------------------------------------------------


def stop_event(stop: asyncio.Event | None = None) -> asyncio.Event:
    """An event (``stop``, or a new one) set by SIGINT or SIGTERM; call from inside the running loop."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    return stop
