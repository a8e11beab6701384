"""``GET /v1/models``: the union of the model ids the routable engines report, cached briefly.

Each routable node's own ``/v1/models`` is asked (concurrently, short timeout; an engine that
fails is skipped), through the proxy's engine transport (``transport.list_models``: the same
connections, URL rule and ``Authorization`` toward engines as forwarded requests). The answer is cached for ``ttl_s``; while it is fresh nothing is fetched. When no engine reports
anything the listing falls back to the pool names.

Routing reads each node's model ids from the snapshot (``NodeView.models``, listed by the
collector: ``scheduler.routing.models``). This cache is the fallback for nodes the collector
has not listed: ``pool_hint`` (model id -> pool) and ``node_models`` (a node URL's own ids, so
a pool name is forwarded as the id of the node picked, never another node's).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from multidict import CIMultiDict

from laswrr.services.proxy.keys import UpstreamAuth
from laswrr.scheduler.routing.router import Router
from laswrr.services.tasks import stop_task
from laswrr.services.proxy.transport import EngineTransport, list_models

log = logging.getLogger("laswrr.proxy.models")


class ModelCatalog:
    def __init__(self, engines: EngineTransport, router: Router, ttl_s: float = 5.0,
                 timeout_s: float = 2.0, auth: UpstreamAuth | None = None) -> None:
        self.engines = engines
        self.router = router
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        headers: CIMultiDict[str] = CIMultiDict()
        (auth or UpstreamAuth()).apply(headers)  # --upstream-api-key, as on forwarded requests
        self.headers = headers
        self.entries: list[dict[str, Any]] = []
        self.model_pools: dict[str, str] = {}
        self.url_models: dict[str, list[str]] = {}  # node URL -> the model ids it listed, in its order
        self.fetched_at: float | None = None
        self._refresh: asyncio.Task[None] | None = None

    def fresh(self) -> bool:
        return self.fetched_at is not None and time.monotonic() - self.fetched_at < self.ttl_s

    async def listing(self) -> dict[str, Any]:
        if not self.fresh():
            await self.refresh()
        data = self.entries or [
            {"id": pool, "object": "model", "created": 0, "owned_by": "laswrr"} for pool in sorted(self.router.table.names())
        ]
        return {"object": "list", "data": data}

    async def pool_hint(self) -> dict[str, str]:
        """model id -> pool; fetched once if never fetched, else refreshed in the background. Each
        refresh makes a new mapping (the proxy keeps a plan made with one while it is current)."""
        await self._current()
        return self.model_pools

    async def node_models(self, url: str) -> list[str]:
        """The model ids the node at ``url`` listed (empty when it listed none, or failed)."""
        await self._current()
        return self.url_models.get(url, [])

    async def _current(self) -> None:
        if self.fetched_at is None:
            await self.refresh()
        elif not self.fresh() and (self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.create_task(self.refresh())

    async def refresh(self) -> None:
        targets = sorted(set(self.router.table.routable_urls()))
        answers = await asyncio.gather(*(self._fetch(url) for _, url in targets))
        entries: dict[str, dict[str, Any]] = {}
        model_pools: dict[str, str] = {}
        url_models: dict[str, list[str]] = {}
        for (pool, url), models in zip(targets, answers):
            url_models[url] = [model["id"] for model in models]
            for model in models:
                entries.setdefault(model["id"], model)
                model_pools.setdefault(model["id"], pool)
        self.entries = [entries[k] for k in sorted(entries)]
        self.model_pools, self.url_models = model_pools, url_models
        self.fetched_at = time.monotonic()

    async def _fetch(self, base_url: str) -> list[dict[str, Any]]:
        models = await list_models(self.engines, base_url, self.timeout_s, self.headers)
        if not models:
            log.debug("no model list from %s", base_url)
        return models

    async def close(self) -> None:
        if self._refresh is not None:
            await stop_task(self._refresh, patience_s=2.0)
