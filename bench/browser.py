"""Headless Chromium driven over the Chrome DevTools protocol: load a page, evaluate, screenshot.

Used by ``make demo`` (``demo-out/dashboard.png``) and by the dashboard's browser tests. The
browser is Debian's ``chromium`` (``apt-get install chromium``; ``chromium_binary`` finds it),
started with a fresh ``--user-data-dir`` and ``--remote-debugging-port=0``; the port it chose
is read from ``DevToolsActivePort`` in that directory, and one page target is driven over its
WebSocket (aiohttp's client: no extra dependency). It never downloads anything, and it is
stopped by its own PID.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from laswrr.services.children import preexec

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--no-default-browser-check",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio")


class BrowserError(RuntimeError):
    """Chromium did not start, a page did not load, or a script failed (the message says which)."""


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Browser:
    """``async with Browser() as browser: await browser.goto(url); await browser.screenshot(path)``."""

    def __init__(self, width: int = 1400, height: int = 1000, binary: str | None = None) -> None:
        self.width, self.height = width, height
        self.binary = binary or chromium_binary()
        self.process: subprocess.Popen[bytes] | None = None
        self._profile: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> "Browser":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self, timeout_s: float = 30.0) -> None:
        if self.binary is None:
            raise BrowserError("no chromium found (Debian: apt-get install chromium)")
        self._profile = tempfile.mkdtemp(prefix="laswrr-chromium-")
        self.process = subprocess.Popen(
            [self.binary, *FLAGS, f"--user-data-dir={self._profile}", "--remote-debugging-port=0",
             "--remote-allow-origins=*", f"--window-size={self.width},{self.height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec())
        port = await self._devtools_port(timeout_s)
        self._session = aiohttp.ClientSession()
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with self._session.get(f"http://127.0.0.1:{port}/json/list") as resp:
                    pages = [t for t in await resp.json() if t.get("type") == "page"]
                if pages:
                    break
            if time.monotonic() > deadline:
                raise BrowserError("chromium lists no page target")
            await asyncio.sleep(0.1)
        self._ws = await self._session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        await self.send("Page.enable")
        await self.send("Runtime.enable")
        await self.send("Emulation.setDeviceMetricsOverride",
                        {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False})

    async def _devtools_port(self, timeout_s: float) -> int:
        assert self._profile is not None and self.process is not None
        marker = Path(self._profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BrowserError(f"chromium exited with {self.process.returncode} at start")
            with contextlib.suppress(OSError, ValueError, IndexError):
                return int(marker.read_text().splitlines()[0])
            await asyncio.sleep(0.05)
        raise BrowserError(f"chromium did not open its DevTools port within {timeout_s:g} s")

    async def _read(self) -> None:
        assert self._ws is not None
        async for message in self._ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(message.data)
            future = self._waiting.pop(data.get("id", -1), None)
            if future is not None and not future.done():
                future.set_result(data)
            elif "method" in data:
                self._events.put_nowait(data)
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(BrowserError("chromium closed the DevTools connection"))

    async def send(self, method: str, params: dict[str, Any] | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
        assert self._ws is not None, "start() first"
        message_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[message_id] = future
        await self._ws.send_str(json.dumps({"id": message_id, "method": method, "params": params or {}}))
        reply = await asyncio.wait_for(future, timeout_s)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message')}")
        return dict(reply.get("result", {}))

    async def goto(self, url: str, timeout_s: float = 30.0) -> None:
        while not self._events.empty():
            self._events.get_nowait()
        result = await self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise BrowserError(f"cannot load {url}: {result['errorText']}")
        deadline = time.monotonic() + timeout_s
        while True:
            event = await asyncio.wait_for(self._events.get(), max(0.1, deadline - time.monotonic()))
            if event.get("method") == "Page.loadEventFired":
                return

    async def evaluate(self, expression: str) -> Any:
        """The JSON value of ``expression`` in the page (promises awaited); BrowserError if it throws."""
        result = await self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                      "awaitPromise": True})
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise BrowserError(f"{expression[:60]!r} threw: {details.get('exception', {}).get('description') or details}")
        return result.get("result", {}).get("value")

    async def wait_for(self, expression: str, timeout_s: float = 15.0, interval_s: float = 0.2) -> Any:
        """Poll ``expression`` until it is truthy; its value (BrowserError with the last value on time-out)."""
        deadline, value = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            value = await self.evaluate(expression)
            if value:
                return value
            await asyncio.sleep(interval_s)
        raise BrowserError(f"{expression!r} still {value!r} after {timeout_s:g} s")

    async def screenshot(self, path: str | os.PathLike[str], full_page: bool = True) -> Path:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = await self.evaluate("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
            params["clip"] = {"x": 0, "y": 0, "width": max(self.width, size[0]), "height": size[1], "scale": 1}
            params["captureBeyondViewport"] = True
        data = (await self.send("Page.captureScreenshot", params))["data"]
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(base64.b64decode(data))
        return target

    async def close(self) -> None:
        if self._ws is not None:
            with contextlib.suppress(Exception):
                await self._ws.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if self._session is not None:
            await self._session.close()
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)  # its own session: chromium and its helpers
            try:
                await asyncio.to_thread(self.process.wait, 10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                await asyncio.to_thread(self.process.wait)
        if self._profile is not None:
            shutil.rmtree(self._profile, ignore_errors=True)
