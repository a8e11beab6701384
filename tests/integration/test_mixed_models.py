"""A pool whose engines serve different model ids, under load, on real processes (docs/wire.md, "Model ids").

The stack (``services.up.Stack``: nats-server, scheduler, recorder, collector, proxy) routes
for two simulated engines in pool ``default``, one serving ``sim-alpha`` and one ``sim-beta``.
The collector lists each engine's ``/v1/models`` into the snapshot; then clients send, all at
once for a few seconds, the pool's name, each model id, a name no engine serves, and a request
an engine refuses (400). What must hold:

* not one attempt reached an engine with a model id it does not serve: no engine 404 at all,
  in the recorded log (``attempts.status``) nor in what the clients got;
* ``"default"`` reached both engines, each answering with its own id; a model id only its engine;
* the unknown name got the router's own 404 (recorded as ``lb.req.refused``, with a request id
  and no node), and the engine's 400 is an ``engine_error``, not ``completed``;
* ``laswrr nodes`` shows each node's model and warns that the pool mixes them; the proxy's
  ``/metrics`` counts answers by who gave them and status class;
* ``laswrr report`` on the recorded log: zero interruptions (nothing cut), and the error
  answers counted by whom and why, with the 404s as the router's; ``laswrr replay`` reproduces
  every output of the log (model lists and refusals included) byte for byte.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from laswrr.replay import store
from tests.model_listing import nodes_once_models_listed
from tests.sim_stack import simulated_stack

pytestmark = pytest.mark.timeout(240)  # a whole stack, started and stopped, on a shared machine

SPEED = 20.0
LOAD_S = 4.0
WORKERS = 12
CHAT = {"max_tokens": 4, "messages": [{"role": "user", "content": "hello"}], "sim": {"x": 1.0}}
# what each client sends, in turn: (name, body changes)
MIX = [("pool", {"model": "default"}), ("alpha", {"model": "sim-alpha"}), ("beta", {"model": "sim-beta"}),
       ("unknown", {"model": "gpt-4"}), ("bad", {"model": "sim-alpha", "n": 2})]


async def _cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "laswrr", *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def _load(url: str) -> list[tuple[str, int, str | None, str | None, dict[str, Any]]]:
    """WORKERS clients for LOAD_S seconds, each sending MIX in turn: (kind, status, node, request id, body)."""
    results: list[tuple[str, int, str | None, str | None, dict[str, Any]]] = []
    deadline = time.monotonic() + LOAD_S

    async def client(session: aiohttp.ClientSession, start: int) -> None:
        i = start
        while time.monotonic() < deadline:
            kind, changes = MIX[i % len(MIX)]
            i += 1
            async with session.post(url + "/v1/chat/completions", json={**CHAT, **changes}) as response:
                body = await response.json(content_type=None)
                results.append((kind, response.status, response.headers.get("x-laswrr-node"),
                                response.headers.get("x-laswrr-request-id"), body))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        await asyncio.gather(*(client(session, k) for k in range(WORKERS)))
    return results


async def test_a_mixed_model_pool_under_load_gets_no_404_from_the_router(tmp_path: Path) -> None:
    async with simulated_stack(tmp_path / "data", [("alpha", "910B", 8), ("beta", "910C", 8)], speed=SPEED,
                               models={"alpha": "sim-alpha", "beta": "sim-beta"}) as stack:
        proxy = await stack.start_proxy()
        nodes = await nodes_once_models_listed(stack.nats_url)
        assert {n["node"]: n["models"] for n in nodes} == {"alpha": ["sim-alpha"], "beta": ["sim-beta"]}

        code, out, err = await _cli("nodes", "--nats-url", stack.nats_url)
        assert code == 0, err
        assert "sim-alpha" in out and "sim-beta" in out and "mixes model ids" in out, out

        results = await _load(proxy)
        async with aiohttp.ClientSession() as session:
            async with session.get(proxy + "/metrics") as response:
                metrics = await response.text()

    by_kind: dict[str, Counter[tuple[int, str | None]]] = {}
    for kind, status, node, _, _ in results:
        by_kind.setdefault(kind, Counter())[(status, node)] += 1
    assert len(results) > 100, len(results)
    # the pool's name reached both engines, each answering as itself
    assert set(by_kind["pool"]) == {(200, "alpha"), (200, "beta")}, by_kind["pool"]
    assert all(body["model"] == f"sim-{node}" for kind, status, node, _, body in results if kind == "pool")
    assert set(by_kind["alpha"]) == {(200, "alpha")} and set(by_kind["beta"]) == {(200, "beta")}, by_kind
    # the unknown name: the router's own 404, never an engine's (no node header)
    assert set(by_kind["unknown"]) == {(404, None)}, by_kind["unknown"]
    unknown = [body for kind, *_, body in results if kind == "unknown"]
    assert "no node of pool 'default' serves it" in unknown[0]["error"]["message"], unknown[0]
    assert all(rid for kind, _, _, rid, _ in results if kind == "unknown")
    # the engine's own 400 passes through
    assert set(by_kind["bad"]) == {(400, "alpha")}, by_kind["bad"]
    counts = {kind: sum(c.values()) for kind, c in by_kind.items()}
    assert f'laswrr_proxy_answers_total{{by="router",class="4xx"}} {float(counts["unknown"])}' in metrics
    assert f'laswrr_proxy_answers_total{{by="engine",class="4xx"}} {float(counts["bad"])}' in metrics

    db = tmp_path / "data" / "events.duckdb"
    with store.open_read(db) as con:
        # no attempt was ever answered 404 by an engine: the router never sent a model id a node does not serve
        assert con.execute("SELECT count(*) FROM attempts WHERE status = 404").fetchone() == (0,)
        assert con.execute("SELECT outcome, status, count(*) FROM attempts WHERE status <> 200 GROUP BY ALL").fetchall() \
            == [("engine_error", 400, counts["bad"])]
        assert con.execute("SELECT cause, status, count(*) FROM refusals GROUP BY ALL").fetchall() == [
            ("unknown_model", 404, counts["unknown"])]

    code, out, err = await _cli("report", "--db", str(db), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["zero_interruptions"] and report["interrupted"] == 0 and report["cut_by_router"] == 0
    assert report["requests"] == counts["pool"] + counts["alpha"] + counts["beta"] + counts["bad"]
    assert report["engine_error"] == counts["bad"] and report["refused"] == counts["unknown"]
    assert report["answered_with_error_by_router"] == counts["unknown"]
    assert report["answered_with_error_by_engine"] == counts["bad"]
    assert report["status_classes"] == {
        "engine": {"2xx": counts["pool"] + counts["alpha"] + counts["beta"], "4xx": counts["bad"]},
        "router": {"4xx": counts["unknown"]}}
    assert {(c["by"], c["cause"], c["count"]) for c in report["top_error_causes"]} == {
        ("router", "unknown_model", counts["unknown"]), ("engine", "HTTP 400", counts["bad"])}
    code, out, err = await _cli("replay", "--db", str(db))
    assert code == 0 and "identical" in out, out + err
    code, out, err = await _cli("report", "--db", str(db))
    assert code == 0, err
    assert "zero interruptions (cut by the router: 0;" in out and "answered with an error" in out and "unknown_model" in out, out
