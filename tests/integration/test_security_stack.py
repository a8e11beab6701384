"""A whole secure stack (``Stack``, as `laswrr up` runs it): per-role NATS users, API keys on the
proxy, and no credential in any argv, log or /metrics of the run."""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import openai
import pytest

from laswrr.replay import store
from laswrr.services.proxy.keys import ApiKeys, KeysFileError, UpstreamAuth, parse_keys
from laswrr.services.up import Stack

from multidict import CIMultiDict

from tests.sim_stack import simulated_stack

CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


async def post(http: aiohttp.ClientSession, url: str, key: str | None, body: dict[str, object] = CHAT,
               ) -> tuple[int, dict[str, str], bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        return response.status, dict(response.headers), await response.read()


def passwords_of(stack: Stack) -> list[str]:
    found = []
    for path in stack.secrets_dir.glob("*.env"):
        password = urlsplit(path.read_text().strip().removeprefix("NATS_URL=")).password
        assert password and len(password) >= 24
        found.append(password)
    return found


async def test_secure_stack_keys_limits_and_no_credential_leaks(tmp_path: Path,
                                                                eventually: Callable[..., Awaitable[Any]]) -> None:
    alice, anon = f"sk-alice-{secrets.token_hex(16)}", f"sk-{secrets.token_hex(16)}"
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(f"# the clients\nalice:{alice}\n\n{anon}\n")
    async with simulated_stack(tmp_path / "data", [("sim-a", "910B", 4)], speed=1.0,
                               proxy_args=("--api-keys", str(keys_file), "--key-max-inflight", "1")) as stack:
        url = await stack.start_proxy(port=0)
        credentials = passwords_of(stack) + [alice, anon]
        for child in stack.children:  # nothing secret in any child's argv
            argv = Path(f"/proc/{child.pid}/cmdline").read_bytes().decode(errors="replace")
            assert not [c for c in credentials if c in argv], (child.name, argv)

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            status, _, body = await post(http, url, None)
            assert status == 401 and json.loads(body) == {"error": {
                "message": "Incorrect or missing API key: send Authorization: Bearer <key>",
                "type": "invalid_request_error", "code": "invalid_api_key", "param": None}}
            assert (await post(http, url, "sk-wrong"))[0] == 401
            status, headers, body = await post(http, url, alice)
            assert status == 200, body
            assert headers["x-laswrr-node"] == "sim-a"

            # one request of alice's in flight: the next one gets 429, another key still passes
            async with http.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {alice}"},
                                 json={**CHAT, "max_tokens": 4000, "stream": True}) as streaming:
                assert streaming.status == 200
                await streaming.content.readany()  # the first chunk: it is in flight
                status, headers, body = await post(http, url, alice)
                assert status == 429 and headers["Retry-After"] == "1"
                assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
                assert (await post(http, url, anon))[0] == 200

            async def alice_idle() -> bool:  # the cancelled stream ends: alice may send again
                async with http.get(f"{url}/metrics") as response:
                    return 'laswrr_proxy_api_key_inflight{key="alice"} 0.0' in await response.text()

            await eventually(alice_idle, what="alice's cancelled stream ended at the proxy")
            assert (await post(http, url, alice))[0] == 200

            async with http.get(f"{url}/healthz") as health:  # probes and /metrics stay open
                assert health.status == 200
            async with http.get(f"{url}/metrics") as response:
                metrics = await response.text()
            async with http.get(f"{url}/v1/models") as models:
                assert models.status == 401
        assert 'laswrr_proxy_api_key_requests_total{key="alice"} 3.0' in metrics
        assert 'laswrr_proxy_api_key_requests_total{key="key-4"} 1.0' in metrics
        assert 'laswrr_proxy_rejected_total{reason="key_max_inflight"} 1.0' in metrics
        assert not [c for c in credentials if c in metrics]

        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=alice, max_retries=0)
        reply = await client.chat.completions.create(model="default", max_tokens=8,
                                                     messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-nope", max_retries=0).chat.completions.create(
                model="default", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        await client.close()

    with store.open_read(stack.data_dir / "events.duckdb") as con:
        started = [json.loads(row[0]) for row in con.execute(
            "SELECT data FROM input_events WHERE family = 'lb.req.started' ORDER BY seq, event_index").fetchall()]
    assert [s["key_name"] for s in started] == ["alice", "alice", "key-4", "alice", "alice"]
    leaks = {}
    for path in stack.log_dir.iterdir():
        text = path.read_text(errors="replace")
        leaks.update({f"{path.name}: {c[:6]}...": True for c in credentials if c in text})
    assert not leaks, leaks
    assert "***@" in (stack.log_dir / "proxy.log").read_text()  # URLs are logged, redacted


def test_keys_file_rules(tmp_path: Path) -> None:
    entries = parse_keys("# c\n\nalice:k1\nk2\n  bob : k3 \n")
    assert [name for name, _ in entries] == ["alice", "key-4", "bob"]
    keys = ApiKeys(entries, max_inflight=2)
    assert keys.identify("Bearer k1") == "alice" and keys.identify("bearer k3") == "bob"
    assert keys.identify("Bearer k") is None and keys.identify("Basic k1") is None and keys.identify(None) is None
    assert keys.acquire("alice") and keys.acquire("alice") and not keys.acquire("alice")
    keys.release("alice")
    assert keys.acquire("alice")
    for text, words in (("", "holds no key"), ("a:b c", "one word"), ("a:x\na:y", "used once"), ("a:", "one word")):
        with pytest.raises(KeysFileError, match=words):
            parse_keys(text)
    with pytest.raises(KeysFileError, match="cannot read the keys file"):
        ApiKeys.load(tmp_path / "missing")


def test_engines_never_see_the_clients_key_unless_forwarded() -> None:
    headers = CIMultiDict({"Authorization": "Bearer client-key", "Content-Type": "application/json"})
    UpstreamAuth().apply(headers)
    assert "Authorization" not in headers
    headers = CIMultiDict({"Authorization": "Bearer client-key"})
    UpstreamAuth(forward_client=True).apply(headers)
    assert headers["Authorization"] == "Bearer client-key"
    headers = CIMultiDict({"Authorization": "Bearer client-key"})
    UpstreamAuth(api_key="engine-key").apply(headers)
    assert headers.getall("Authorization") == ["Bearer engine-key"]
