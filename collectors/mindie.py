"""Pure parsers for MindIE Server's management-port status: ``GET /v1/status`` (and
``/v2/status``) and ``GET /metrics-json``.

Rules
-----
* Pure functions of ``str``: no I/O, clock, randomness or logging. The poller is
  ``collectors.exporter`` (the IO half for the Ascend sources).
* Every malformed input raises ``collectors.errors.ParseError`` (one line), never another
  exception type: not JSON, not an object, a missing ``service``/``resource`` object, a count
  that is missing, negative, fractional, boolean or beyond 2^53.

``/v1/status``, ``/v2/status`` (Ascend/MindIE-LLM ``src/server/endpoint/http_wrapper/
http_handler.cpp`` ``HandleStatusV1``/``HandleStatusV2``/``SetJsonObj``; checked by
Ascend/MindIE-Motor's controller ``ServerRequestHandler``, which requires the counts below)
----------------------------------------------------------------------------------------
* ``service.roleStatus`` (``RoleUnknown`` / ``RoleSwitching`` / ``RoleReady``),
  ``service.currentRole`` (``prefill`` / ``decode`` / ``none``; ``flex`` with ``p_percentage``).
* Single-node form: ``resource.availSlotsNum`` (free decode slots, 0..5000 per the
  controller), ``availBlockNum`` (KV blocks the scheduler can still hand out), and, from
  ``SetJsonObj``, ``waitingRequestNum``, ``runningRequestNum``, ``swappedRequestNum``,
  ``freeNpuBlockNums``, ``freeCpuBlockNums``, ``totalNpuBlockNums``, ``totalCpuBlockNums``.
* Multi-node form (A3 / DeepSeek class, the controller's multi-node mode): ``resource.
  totalAvailNpuSlotsNum``, ``totalAvailNpuBlockNum``, ``maxAvailNpuBlockNum`` (the largest
  free-block count of one DP instance, ``dpInstMap``), without waiting or running counts.
  ``/v2/status`` carries both sets; the single-node counts are preferred when present.
* ``ready`` is ``roleStatus == "RoleReady"``: MindIE-Motor routes only to ready instances, and
  laswrr treats a status that is not ready as a missing sample (its counts are in flux).

``/metrics-json`` (MindIE-LLM ``JsonParse::JsonHttpMetrics``)
-------------------------------------------------------------
``{"resultType": "vector", "result": [{"metric": [{"__name__": NAME, "job": "node",
"instance": "ip:port"}], "value": "123"}, ...]}`` with NAME ``TTFT``, ``TBT`` (integer means
over the last 1000 requests, ``DYNAMIC_AVERAGE_WINDOW_SIZE``; 0 before the first),
``waitingInferRequestNum``, ``processingInferRequestNum``, ``remainBlocks``. Values are
strings of numbers. A missing name is None; an unreadable value raises ParseError.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import msgspec

from laswrr.collectors.errors import ParseError
from laswrr.schemas.events import EngineSampled

__all__ = ["MetricsJson", "MindieStatus", "parse_metrics_json", "parse_status", "with_status"]

MAX_COUNT = 2**53
ROLE_STATUSES = ("RoleUnknown", "RoleSwitching", "RoleReady")


@dataclass(frozen=True)
class MindieStatus:
    """One ``/v1/status`` or ``/v2/status`` answer. None = the form has no such count."""

    ready: bool
    role_status: str
    current_role: str
    avail_slots: int  # availSlotsNum, or totalAvailNpuSlotsNum in the multi-node form
    avail_blocks: int  # availBlockNum, or totalAvailNpuBlockNum
    multi_node: bool
    waiting: int | None = None
    running: int | None = None
    swapped: int | None = None
    free_npu_blocks: int | None = None
    total_npu_blocks: int | None = None
    max_avail_blocks: int | None = None  # maxAvailNpuBlockNum (multi-node)


@dataclass(frozen=True)
class MetricsJson:
    ttft_ms: float | None = None
    tbt_ms: float | None = None
    waiting: int | None = None
    processing: int | None = None
    remain_blocks: int | None = None


def _json_object(text: str, what: str) -> dict[str, Any]:
    if not text.strip():
        raise ParseError(f"empty {what} body")
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ParseError(f"{what} is not JSON: {str(exc)[:120]}") from None
    if not isinstance(document, dict):
        raise ParseError(f"{what} is not a JSON object")
    return document


def _count(table: dict[str, Any], key: str, where: str, required: bool) -> int | None:
    value = table.get(key)
    if value is None:
        if required:
            raise ParseError(f"{where}: {key} is missing")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ParseError(f"{where}: {key} = {value!r} is not a number")
    if isinstance(value, float) and (not math.isfinite(value) or not value.is_integer()):
        raise ParseError(f"{where}: {key} = {value!r} is not a whole count")
    if not 0 <= value <= MAX_COUNT:
        raise ParseError(f"{where}: {key} = {value!r} is out of range 0..2^53")
    return int(value)


def parse_status(text: str) -> MindieStatus:
    """A MindIE ``/v1/status`` or ``/v2/status`` body, single- or multi-node form."""
    document = _json_object(text, "MindIE status")
    service, resource = document.get("service"), document.get("resource")
    if not isinstance(service, dict) or not isinstance(resource, dict):
        raise ParseError("MindIE status needs 'service' and 'resource' objects")
    role_status, role = service.get("roleStatus"), service.get("currentRole", "none")
    if not isinstance(role_status, str) or not isinstance(role, str):
        raise ParseError("MindIE status: service.roleStatus and service.currentRole must be strings")
    where = "MindIE status resource"
    single = "availSlotsNum" in resource
    if not single and "totalAvailNpuSlotsNum" not in resource:
        raise ParseError(f"{where}: neither availSlotsNum (single-node) nor totalAvailNpuSlotsNum (multi-node)")
    slots_key, blocks_key = ("availSlotsNum", "availBlockNum") if single else \
        ("totalAvailNpuSlotsNum", "totalAvailNpuBlockNum")
    slots = _count(resource, slots_key, where, required=True)
    blocks = _count(resource, blocks_key, where, required=True)
    assert slots is not None and blocks is not None
    free = _count(resource, "freeNpuBlockNums", where, required=False)
    total = _count(resource, "totalNpuBlockNums", where, required=False)
    if free is not None and total is not None and total and free > total:
        raise ParseError(f"{where}: freeNpuBlockNums {free} > totalNpuBlockNums {total}")
    return MindieStatus(
        ready=role_status == "RoleReady", role_status=role_status[:64], current_role=role[:64],
        avail_slots=slots, avail_blocks=blocks, multi_node=not single,
        waiting=_count(resource, "waitingRequestNum", where, required=False),
        running=_count(resource, "runningRequestNum", where, required=False),
        swapped=_count(resource, "swappedRequestNum", where, required=False),
        free_npu_blocks=free, total_npu_blocks=total or None,
        max_avail_blocks=_count(resource, "maxAvailNpuBlockNum", where, required=False))


_METRICS_JSON = {"TTFT": "ttft_ms", "TBT": "tbt_ms", "waitingInferRequestNum": "waiting",
                 "processingInferRequestNum": "processing", "remainBlocks": "remain_blocks"}


def parse_metrics_json(text: str) -> MetricsJson:
    """A MindIE ``/metrics-json`` body; names it does not carry are None."""
    document = _json_object(text, "MindIE /metrics-json")
    result = document.get("result")
    if not isinstance(result, list):
        raise ParseError("MindIE /metrics-json: 'result' must be a list")
    found: dict[str, float | int] = {}
    for index, item in enumerate(result):
        if not isinstance(item, dict):
            raise ParseError(f"MindIE /metrics-json: result[{index}] is not an object")
        labels = item.get("metric")
        labels = labels[0] if isinstance(labels, list) and labels else labels
        name = labels.get("__name__") if isinstance(labels, dict) else None
        field = _METRICS_JSON.get(name) if isinstance(name, str) else None
        if field is None:
            continue
        raw = item.get("value")
        try:
            value = float(raw) if isinstance(raw, (str, int, float)) and not isinstance(raw, bool) else math.nan
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or not 0 <= value <= MAX_COUNT:
            raise ParseError(f"MindIE /metrics-json: {name} value {raw!r} is not a number >= 0")
        found[field] = value if field.endswith("_ms") else int(value)
    if not found:
        raise ParseError("MindIE /metrics-json: none of TTFT, TBT, waitingInferRequestNum, "
                         "processingInferRequestNum, remainBlocks")
    if found.get("ttft_ms") == 0:
        found["ttft_ms"] = None  # type: ignore[assignment]  # 0 = no request finished yet
    if found.get("tbt_ms") == 0:
        found["tbt_ms"] = None  # type: ignore[assignment]
    return MetricsJson(**found)  # type: ignore[arg-type]


def with_status(base: EngineSampled | None, status: MindieStatus, extra: MetricsJson | None = None,
                ts_ns: int | None = None) -> EngineSampled | None:
    """The engine sample with what the status says: ``free_slots`` = available slots,
    ``free_blocks`` = free NPU KV blocks (``freeNpuBlockNums``, else the available blocks),
    ``total_blocks`` = ``totalNpuBlockNums``; running and waiting from the status when its form
    has them (the same instant as the free counts). Without a ``/metrics`` sample (``base`` None:
    MindIE's Prometheus endpoint is off unless ``MIES_SERVICE_MONITOR_MODE=1``) the sample is
    built from the status alone, KV use = 1 - free/total and TTFT the ``/metrics-json`` mean;
    None when the status cannot make one (multi-node form, no block total): the sample is missing.
    A status that is not ready is never passed here (the poller counts it as missing)."""
    free_blocks = status.free_npu_blocks if status.free_npu_blocks is not None else status.avail_blocks
    total = status.total_npu_blocks
    counts = {"free_slots": status.avail_slots, "free_blocks": free_blocks, "total_blocks": total}
    if base is not None:
        running = status.running if status.running is not None else base.running
        waiting = status.waiting if status.waiting is not None else base.waiting
        return msgspec.structs.replace(base, running=running, waiting=waiting, **counts)
    if status.running is None or status.waiting is None or not total:
        return None
    kv = round(min(1.0, max(0.0, 1.0 - free_blocks / total)), 6)
    return EngineSampled(running=status.running, waiting=status.waiting, kv_cache_usage=kv,
                         ttft_ms=extra.ttft_ms if extra is not None else None, engine="mindie", ts_ns=ts_ns, **counts)

