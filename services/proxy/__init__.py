"""The OpenAI-compatible proxy: routes each request on the newest LA-SWRR snapshot, never cuts one.

Modules: ``config`` (ProxyConfig), ``routing`` (snapshot holder + pick policy + live in-flight),
``upstream`` (forwarding, streaming, retries, outcomes), ``events`` (non-blocking JetStream
publisher), ``bus`` (NATS connection and LB_WEIGHTS watch), ``models`` (/v1/models catalog),
``metrics`` (Prometheus), ``app`` (aiohttp app and graceful stop), ``cli`` (`laswrr proxy`).
"""
