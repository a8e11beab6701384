"""An engine's non-JSON error answer becomes an OpenAI-style error; JSON ones and
successes pass unchanged. The real plain-text 413 comes from a real simulated engine's aiohttp."""

from __future__ import annotations

import json

from laswrr.services.proxy.engine_errors import as_openai_error


def test_a_plain_text_413_becomes_an_openai_error_with_its_status_and_text() -> None:
    headers = {"Content-Type": "text/plain; charset=utf-8", "Content-Length": "63", "x-laswrr-node": "n1"}
    body, out = as_openai_error(413, "text/plain", b"Maximum request body size 1048576 exceeded, actual body size 3145728",
                                headers)
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("the engine answered HTTP 413: Maximum request body size 1048576 exceeded")
    assert out["Content-Type"] == "application/json" and "Content-Length" not in out and out["x-laswrr-node"] == "n1"


def test_json_errors_and_successes_pass_unchanged() -> None:
    original = b'{"error": {"message": "bad", "type": "BadRequestError", "code": 400}}'
    assert as_openai_error(400, "application/json", original, {})[0] == original
    assert as_openai_error(200, "text/plain", b"ok", {})[0] == b"ok"
    body, _ = as_openai_error(502, "text/html", b"<html>" + b"x" * 1000 + b"</html>", {})
    error = json.loads(body)["error"]
    assert error["type"] == "api_error" and error["code"] is None and len(error["message"]) < 360
