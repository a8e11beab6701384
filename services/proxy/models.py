"""``GET /v1/models``: the union of the model ids the routable engines report, cached briefly.

Each routable node's own ``/v1/models`` is asked (concurrently, short timeout; an engine that
fails is skipped). The answer is cached for ``ttl_s``; while it is fresh nothing is fetched. The
same listing maps a model id to the pool whose engines serve it, so a request for
``Qwen/Qwen2.5-7B`` reaches the pool serving it even though pool names are single tokens; and
a pool to the model id its engines serve (``served_model``), so a request naming the pool
(``"model": "default"``) can be forwarded with the id the engines know. When no engine reports
anything the listing falls back to the pool names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp

from laswrr.services.proxy.routing import Router
from laswrr.services.proxy.tasks import stop_task
from laswrr.services.proxy.upstream import upstream_url

log = logging.getLogger("laswrr.proxy.models")


class ModelCatalog:
    def __init__(self, session: aiohttp.ClientSession, router: Router, ttl_s: float = 5.0,
                 timeout_s: float = 2.0) -> None:
        self.session = session
        self.router = router
        self.ttl_s = ttl_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.entries: list[dict[str, Any]] = []
        self.model_pools: dict[str, str] = {}
        self.pool_models: dict[str, str] = {}  # pool -> the (first, by node URL) model id its engines serve
        self.fetched_at: float | None = None
        self._refresh: asyncio.Task[None] | None = None

    def fresh(self) -> bool:
        return self.fetched_at is not None and time.monotonic() - self.fetched_at < self.ttl_s

    async def listing(self) -> dict[str, Any]:
        if not self.fresh():
            await self.refresh()
        data = self.entries or [
            {"id": pool, "object": "model", "created": 0, "owned_by": "laswrr"} for pool in sorted(self.router.pools)
        ]
        return {"object": "list", "data": data}

    async def pool_hint(self) -> dict[str, str]:
        """model id -> pool; fetched once if never fetched, else refreshed in the background."""
        await self._current()
        return self.model_pools

    async def served_model(self, pool: str) -> str | None:
        """The model id the engines of ``pool`` serve (None when none reported one)."""
        await self._current()
        return self.pool_models.get(pool)

    async def _current(self) -> None:
        if self.fetched_at is None:
            await self.refresh()
        elif not self.fresh() and (self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.create_task(self.refresh())

    async def refresh(self) -> None:
        targets = sorted(set(self.router.routable_urls()))
        answers = await asyncio.gather(*(self._fetch(url) for _, url in targets))
        entries: dict[str, dict[str, Any]] = {}
        model_pools: dict[str, str] = {}
        pool_models: dict[str, str] = {}
        for (pool, _), models in zip(targets, answers):
            for model in models:
                entries.setdefault(model["id"], model)
                model_pools.setdefault(model["id"], pool)
                pool_models.setdefault(pool, model["id"])
        self.entries = [entries[k] for k in sorted(entries)]
        self.model_pools, self.pool_models = model_pools, pool_models
        self.fetched_at = time.monotonic()

    async def _fetch(self, base_url: str) -> list[dict[str, Any]]:
        with contextlib.suppress(Exception):
            async with self.session.get(upstream_url(base_url, "/v1/models"), timeout=self.timeout) as resp:
                if resp.status != 200:
                    return []
                body = await resp.json(content_type=None)
                data = body.get("data") if isinstance(body, dict) else None
                return [m for m in data or [] if isinstance(m, dict) and isinstance(m.get("id"), str)]
        log.debug("no model list from %s", base_url)
        return []

    async def close(self) -> None:
        if self._refresh is not None:
            await stop_task(self._refresh, patience_s=2.0)
