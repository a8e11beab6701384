"""``--log-format json``: one JSON object per line with service, level, logger, message and fields."""

from __future__ import annotations

import argparse
import io
import json
import logging
import signal
import socket
import subprocess
import sys

from laswrr.services import settings


def test_json_lines_carry_service_level_message_and_extra_fields() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers = []
    try:
        settings.configure_logging(argparse.Namespace(log_level="INFO", log_format="json"), "scheduler")
        stream = io.StringIO()
        root.handlers[0].setStream(stream)  # type: ignore[attr-defined]
        logging.getLogger("laswrr.test").info("applied %d events", 3, extra={"node": "n1", "seq": 7})
        logging.getLogger("laswrr.test").debug("not at info")
        record = json.loads(stream.getvalue())
    finally:
        root.handlers, root.level = saved
    assert {k: record[k] for k in ("service", "level", "logger", "message", "node", "seq")} == {
        "service": "scheduler", "level": "INFO", "logger": "laswrr.test", "message": "applied 3 events",
        "node": "n1", "seq": 7}
    assert record["time"].endswith("+00:00")


def test_proxy_with_log_level_warning_and_log_format_json_logs_json_lines() -> None:
    with socket.socket() as sock:  # a port nothing listens on: NATS unreachable, so the proxy warns
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "laswrr", "proxy", "--port", "0", "--host", "127.0.0.1",
                             "--nats-url", f"nats://127.0.0.1:{closed}", "--log-level", "warning",
                             "--log-format", "JSON"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("proxy listening on ")
        assert proc.stderr is not None
        first = proc.stderr.readline()  # its first log line: NATS unreachable (the test's timeout bounds the wait)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    lines = [json.loads(line) for line in (first + err).splitlines() if line.strip()]  # each line one JSON object
    assert lines, "nothing logged"
    assert {line["service"] for line in lines} == {"proxy"}
    assert {line["level"] for line in lines} <= {"WARNING", "ERROR", "CRITICAL"}  # no INFO at warning
    assert all(isinstance(line["message"], str) and line["time"] for line in lines)


def test_every_command_with_log_level_takes_log_format() -> None:
    from laswrr.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    with_level = {name for name, sub in commands.items() if "--log-level" in sub._option_string_actions}
    assert {"proxy", "scheduler", "recorder", "collector", "up", "sim-engine"} <= with_level
    for name in with_level:
        assert "--log-format" in commands[name]._option_string_actions, name
