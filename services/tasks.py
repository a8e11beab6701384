"""Stopping background tasks for sure, on a Python whose ``asyncio.wait_for`` can lose a cancellation.

Theory of operation. On Python 3.11, ``asyncio.wait_for(fut, timeout)`` returns ``fut``'s result
instead of raising ``CancelledError`` when the cancel arrives in the same loop iteration as the
result (CPython gh-86296, fixed in 3.12's rewrite of ``wait_for``). nats-py awaits every request
(``stream_info``, ``key_value``, ``consumer_info``...) that way, and a NATS reply often lands in the
same socket read as the acks the shutdown path is waiting for, so a single ``task.cancel()`` of a
task in the middle of a request is lost now and then: the task runs on (into a KV watch that
never ends) and whoever awaits it hangs. ``stop_task`` therefore cancels again until the task has
really ended, and gives up (logging) after ``patience_s`` instead of hanging. ``bounded`` runs
one awaitable with a deadline the same way, without ``wait_for``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("laswrr.tasks")

RECANCEL_S = 0.05


async def stop_task(task: asyncio.Task[Any], patience_s: float = 5.0) -> bool:
    """Cancel ``task`` (again and again) until it has ended; False if it still runs after ``patience_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience_s
    while not task.done():
        if loop.time() >= deadline:
            log.error("task %s did not stop within %.1f s of being cancelled", task.get_name(), patience_s)
            return False
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S)
    if not task.cancelled() and task.exception() is not None:
        log.debug("task %s ended with %r", task.get_name(), task.exception())
    return True


async def bounded(coro: Coroutine[Any, Any, Any], timeout_s: float, name: str) -> bool:
    """Run ``coro`` for at most ``timeout_s``; stop it when late. True if it finished in time (even by raising)."""
    task = asyncio.create_task(coro, name=name)
    try:
        await asyncio.wait({task}, timeout=timeout_s)
        in_time = task.done()
    finally:
        if not task.done():
            await stop_task(task, patience_s=1.0)
    if not task.cancelled() and task.exception() is not None:
        log.debug("%s failed: %r", name, task.exception())
    return in_time
