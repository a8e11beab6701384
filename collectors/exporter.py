"""The IO half of the Ascend sources: npu-exporter scrapes, MindIE status polls, the fault table.

Theory of operation
-------------------
* ``scrape_exporter`` GETs one host's npu-exporter ``/metrics`` and parses it
  (``collectors.npu_exporter``) against the caller's clock: a chip whose exporter cache is
  older than ``max_age_s`` is left out as missing. ``poll_status`` GETs a MindIE ``/v1/status``
  (or ``/v2/status``) and, only when that engine's ``/metrics`` could not be read,
  ``/metrics-json`` on the same management port (``metrics_json_url``). None of them raises
  for what the remote side does: the outcome (``ok``, ``http_error``, ``timeout``,
  ``unreachable``, ``garbage``, and ``not_ready`` for a MindIE role that is not RoleReady) and a
  one-line error come back as values the poller counts.
* ``load_fault_table`` reads collectors/faultcodes.toml (or an operator's copy); a bad file is
  a ``ParseError`` naming it.
* Pacing is the poller's (collectors/poller.py): one exporter scrape per host per exporter
  refresh (5 s default, never below 1 s, far under npu-exporter's 20 requests per second per
  client IP), status with the node's engine scrape.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from laswrr.collectors.engine import Outcome, get_text
from laswrr.collectors.errors import ParseError
from laswrr.collectors.faultcodes import FaultTable, fault_table
from laswrr.collectors.mindie import MetricsJson, MindieStatus, parse_metrics_json, parse_status
from laswrr.collectors.npu_exporter import ExporterScrape, parse_exporter

MIN_EXPORTER_INTERVAL_S = 1.0  # npu-exporter's -updateTime is 1..60 s; polling faster reads the same cache


@dataclass(frozen=True, slots=True)
class Polled:
    outcome: str
    value: ExporterScrape | MindieStatus | MetricsJson | None = None
    error: str | None = None


def load_fault_table(path: str | Path | None = None) -> FaultTable:
    """The fault-code table shipped in collectors/faultcodes.toml, or the file at ``path``."""
    try:
        text = (Path(path).read_text(encoding="utf-8") if path is not None
                else resources.files("laswrr.collectors").joinpath("faultcodes.toml").read_text(encoding="utf-8"))
    except OSError as exc:
        raise ParseError(f"cannot read fault-code table {path}: {exc.strerror or exc}") from None
    try:
        return fault_table(text)
    except ParseError as exc:
        raise ParseError(f"{path or 'collectors/faultcodes.toml'}: {exc}") from None


def metrics_json_url(status_url: str) -> str:
    """``/metrics-json`` on the management port that serves ``status_url``."""
    parts = urlsplit(status_url)
    return urlunsplit((parts.scheme, parts.netloc, "/metrics-json", "", ""))


async def _polled(outcome: Outcome, text: str | None, error: str | None, parse: object) -> Polled:
    if text is None:
        return Polled(outcome, error=error)
    try:
        return Polled("ok", parse(text))  # type: ignore[operator]
    except ParseError as exc:
        return Polled("garbage", error=str(exc))


async def scrape_exporter(session: aiohttp.ClientSession, url: str, timeout_s: float, now_s: float,
                          max_age_s: float) -> Polled:
    outcome, text, error = await get_text(session, url, timeout_s)
    return await _polled(outcome, text, error, lambda t: parse_exporter(t, now_s=now_s, max_age_s=max_age_s))


async def poll_status(session: aiohttp.ClientSession, url: str, timeout_s: float) -> Polled:
    outcome, text, error = await get_text(session, url, timeout_s)
    polled = await _polled(outcome, text, error, parse_status)
    if isinstance(polled.value, MindieStatus) and not polled.value.ready:
        return Polled("not_ready", polled.value, f"role status {polled.value.role_status}")
    return polled


async def poll_metrics_json(session: aiohttp.ClientSession, url: str, timeout_s: float) -> Polled:
    outcome, text, error = await get_text(session, url, timeout_s)
    return await _polled(outcome, text, error, parse_metrics_json)
