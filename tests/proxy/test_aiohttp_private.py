"""aiohttp's non-public parts the proxy uses, all in services/proxy/engine_client.py (its header
lists them): fail loudly, naming the part, when an aiohttp upgrade removes or changes one, and
when another module starts using one. Their behaviour is the engine transport's contract
(tests/proxy/test_engine_transport.py) and the proxy's own tests (413 on client_max_size)."""

from __future__ import annotations

import asyncio
import inspect
import re
from pathlib import Path

from aiohttp import web
from aiohttp.client_proto import ResponseHandler
from aiohttp.http_exceptions import BadStatusLine, HttpProcessingError
from aiohttp.streams import StreamReader

from laswrr.services.proxy import engine_client

ROOT = Path(__file__).resolve().parents[2]
PRIVATE = re.compile(r"aiohttp\.(client_proto|streams|http_exceptions|http_parser|base_protocol)\b"
                     r"|BaseRequest\(|\._server\b")


def parameters(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


def test_the_response_handler_has_what_the_engine_client_calls() -> None:
    assert issubclass(engine_client.EngineConnection, ResponseHandler)
    assert parameters(ResponseHandler.__init__)[:2] == ["self", "loop"]
    given = {"skip_payload", "read_until_eof", "auto_decompress", "read_timeout", "read_bufsize", "max_line_size",
             "max_field_size"}
    assert given <= set(parameters(ResponseHandler.set_response_params)), "set_response_params changed"
    for name in ("start_timeout", "read", "is_connected", "close", "connection_made", "data_received"):
        assert callable(getattr(ResponseHandler, name, None)), f"ResponseHandler.{name} is gone"
    assert isinstance(inspect.getattr_static(ResponseHandler, "should_close"), property)


async def test_the_response_handler_behaves_as_used() -> None:
    """A fresh protocol: not connected, read() waits for a message, start_timeout is callable."""
    protocol = engine_client.EngineConnection(asyncio.get_running_loop())
    assert not protocol.is_connected() and protocol.transport is None and not protocol.should_close
    assert inspect.iscoroutinefunction(ResponseHandler.read)
    assert not protocol  # a queue, false while empty: why EnginePool never writes `take() or connect()`


def test_the_stream_reader_has_what_the_forwarder_reads() -> None:
    for name in ("read", "readany"):
        assert inspect.iscoroutinefunction(getattr(StreamReader, name)), f"StreamReader.{name} changed"
    for name in ("read_nowait", "at_eof", "is_eof"):
        assert callable(getattr(StreamReader, name, None)), f"StreamReader.{name} is gone"


def test_base_request_takes_what_request_factory_gives() -> None:
    assert parameters(web.BaseRequest.__init__)[:7] == ["self", "message", "payload", "protocol", "payload_writer",
                                                        "task", "loop"]
    assert "client_max_size" in parameters(web.BaseRequest.__init__)
    assert "request_factory" in parameters(web.Server.__init__)
    assert issubclass(BadStatusLine, HttpProcessingError) and engine_client.HttpProcessingError is HttpProcessingError


async def test_request_factory_makes_requests_with_the_body_limit() -> None:
    make = engine_client.request_factory(1234)
    assert parameters(make) == ["message", "payload", "protocol", "writer", "task"]


def test_no_other_module_uses_them() -> None:
    allowed = {ROOT / "services" / "proxy" / "engine_client.py"}
    users = []
    for path in sorted(ROOT.glob("**/*.py")):
        if path in allowed or ".venv" in path.parts or path.parent.name == "tests" and path.name == Path(__file__).name:
            continue
        if path.parts[len(ROOT.parts)] not in {"schemas", "scheduler", "collectors", "replay", "services", "bench",
                                                "deploy"}:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if PRIVATE.search(line):
                users.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert users == [], "aiohttp's private parts outside services/proxy/engine_client.py:\n" + "\n".join(users)
