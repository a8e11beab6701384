"""Test helper: a running stack's snapshot of pool ``default`` once the collector has listed every
node's model ids (``/v1/models``) into it."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import nats

from laswrr.schemas import subjects as sj


async def nodes_once_models_listed(nats_url: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The nodes of pool ``default``'s newest snapshot, as soon as each names its ``models``."""
    nc = await nats.connect(nats_url)
    try:
        kv = await nc.jetstream().key_value(sj.WEIGHTS_BUCKET)
        deadline = time.monotonic() + timeout_s
        while True:
            nodes = json.loads((await kv.get("default")).value or b"{}")["nodes"]
            if all(n.get("models") for n in nodes):
                return nodes
            assert time.monotonic() < deadline, f"model ids not in the snapshot: {nodes}"
            await asyncio.sleep(0.2)
    finally:
        await nc.close()
