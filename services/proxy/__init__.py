"""The OpenAI-compatible proxy: routes each request on the newest LA-SWRR snapshot, never cuts one.

Modules: ``config`` (ProxyConfig), ``upstream`` (forwarding, streaming, retries, outcomes),
``events`` (non-blocking JetStream publisher), ``bus`` (NATS connection and LB_WEIGHTS watch),
``models`` (/v1/models catalog), ``metrics`` (Prometheus), ``app`` (aiohttp app and graceful
stop), ``cli`` (`laswrr proxy`).
What it routes with (the snapshot table, the pick, admission, prompt sizes, continuation
planning) is the pure package ``scheduler.routing``: this package feeds it time and bytes.
"""
