"""``laswrr_build_info{version}`` on every laswrr /metrics: the services' (serve_metrics) and the proxy's."""

from __future__ import annotations

import socket

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from laswrr import __version__
from laswrr.services.proxy.app import start
from laswrr.services.proxy.config import ProxyConfig
from laswrr.services.service_metrics import gauge, render, serve_metrics


def build_info(text: str) -> list[dict[str, str]]:
    return [sample.labels for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == "laswrr_build_info" and sample.value == 1]


async def test_service_metrics_and_the_proxy_carry_build_info() -> None:
    runner = await serve_metrics(0, lambda: render(lambda: iter([gauge("laswrr_test_up", "test", 1)])),
                                 host="127.0.0.1", service="test")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        nowhere = sock.getsockname()[1]
    proxy = await start(ProxyConfig(nats_url=f"nats://127.0.0.1:{nowhere}", host="127.0.0.1", port=0, proxy_id="p"))
    try:
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as http:
            for url in (f"http://127.0.0.1:{port}/metrics", f"{proxy.url}/metrics"):
                async with http.get(url) as response:
                    text = await response.text()
                assert build_info(text) == [{"version": __version__}], url
    finally:
        await proxy.stop()
        await runner.cleanup()
