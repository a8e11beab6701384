"""deploy/healthcheck.py, the containers' health checks, against a real monitored nats-server."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from laswrr.services.natsbus import ensure_streams
from laswrr.services.nats_server import free_port, nats_server_binary

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "healthcheck.py"


@pytest.fixture
def monitored_nats(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(client URL, monitoring URL) of a nats-server with JetStream and -m."""
    port, monitor = free_port(), free_port()
    process = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor),
                                "-js", "-sd", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", monitor), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline and process.poll() is None, "nats-server did not start"
                time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}", f"http://127.0.0.1:{monitor}"
    finally:
        process.terminate()
        process.wait(10)


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=20)


async def test_nats_client_check_sees_the_named_connection_and_streams(monitored_nats: tuple[str, str]) -> None:
    url, monitor = monitored_nats
    absent = check("nats-client", "laswrr-scheduler-a", "--monitor-url", monitor)
    assert absent.returncode == 1 and "no NATS connection named 'laswrr-scheduler-a'" in absent.stderr
    nc = await nats.connect(url, name="laswrr-scheduler-a")
    try:
        assert check("nats-client", "laswrr-scheduler-a", "--monitor-url", monitor).returncode == 0
        no_streams = check("nats-client", "laswrr-scheduler-a", "--stream", "LB_EVENTS", "--monitor-url", monitor)
        assert no_streams.returncode == 1 and "LB_EVENTS" in no_streams.stderr
        await ensure_streams(nc.jetstream())
        both = check("nats-client", "laswrr-scheduler-a", "--stream", "LB_EVENTS", "--stream", "LB_OUT",
                     "--monitor-url", monitor)
        assert both.returncode == 0, both.stderr
    finally:
        await nc.close()


def test_http_check(monitored_nats: tuple[str, str]) -> None:
    _, monitor = monitored_nats
    assert check("http", f"{monitor}/healthz").returncode == 0
    missing = check("http", f"{monitor}/no-such-page")
    assert missing.returncode == 1 and "HTTP 404" in missing.stderr
    refused = check("--timeout-s", "1", "http", f"http://127.0.0.1:{free_port()}/health")
    assert refused.returncode == 1 and refused.stderr.startswith("unhealthy:")


def test_auto_probe_follows_the_containers_command() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("healthcheck", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    probe = module.auto_probe
    assert probe(["/sbin/docker-init", "--", "laswrr", "proxy", "--port", "9000"], {}) == \
        "http://127.0.0.1:9000/readiness"
    assert probe(["/usr/local/bin/laswrr", "proxy"], {"LASWRR_PORT": "8100"}) == "http://127.0.0.1:8100/readiness"
    assert probe(["laswrr", "proxy"], {}) == "http://127.0.0.1:8000/readiness"
    assert probe(["laswrr", "sim-engine", "--port=8001", "--chip", "910C"], {}) == "http://127.0.0.1:8001/health"
    assert probe(["laswrr", "collector", "--nodes", "n.toml", "--metrics-port", "9100"], {}) == \
        "http://127.0.0.1:9100/metrics"
    assert probe(["laswrr", "collector", "--nodes", "n.toml"], {}) is None  # no metrics port: nothing to probe
    assert probe(["laswrr", "scheduler", "--replica-id", "a"], {}) is None
    assert probe(["python", "-m", "laswrr", "proxy", "--port", "1"], {}) == "http://127.0.0.1:1/readiness"


async def test_auto_check_of_a_real_proxy_is_its_readiness() -> None:
    from laswrr.services.proxy.app import start
    from laswrr.services.proxy.config import ProxyConfig

    proxy = await start(ProxyConfig(nats_url=f"nats://127.0.0.1:{free_port()}", host="127.0.0.1", port=0,
                                    proxy_id="p", grace_s=0))
    try:
        import asyncio

        run = await asyncio.to_thread(check, "auto", "--cmdline", f"laswrr proxy --port {proxy.port}")
        assert run.returncode == 1 and "/readiness: HTTP 503" in run.stderr  # alive, no snapshot yet
        idle = await asyncio.to_thread(check, "auto", "--cmdline", "laswrr recorder --data-dir /data")
        assert idle.returncode == 0 and "serves no HTTP probe" in idle.stdout
    finally:
        await proxy.stop()
