"""Defaults and lifecycle helpers shared by the service commands (scheduler, operator, up).

Rules: every service takes ``--nats-url`` (default: the ``NATS_URL`` environment variable, else
``nats://127.0.0.1:4222``), logs with ``logging`` to stderr, and stops cleanly on SIGINT or
SIGTERM: ``stop_event()`` turns either signal into an ``asyncio.Event`` the service awaits, so
the service can finish its batch, drain its NATS connection and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_DATA_DIR = ".laswrr"
DEFAULT_TICK_MS = 100
DEFAULT_PROXY_PORT = 8000
MSG_ID = "Nats-Msg-Id"
CHECKPOINT_BUCKET = "LB_CHECKPOINT"


def default_nats_url() -> str:
    return os.environ.get("NATS_URL") or DEFAULT_NATS_URL


def add_nats_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default=default_nats_url(), metavar="URL",
                        help=f"NATS server (default: $NATS_URL or {DEFAULT_NATS_URL})")


def add_verbosity(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def configure_logging(verbose: bool = False, name: str = "laswrr") -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    logging.getLogger("nats").setLevel(logging.WARNING)


def stop_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (call from inside the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    return stop
