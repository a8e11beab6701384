"""Pure parser for MindCluster npu-exporter's Prometheus text (``GET :8082/metrics``).

Rules
-----
* Pure functions of ``str`` (and of the caller's clock reading, passed in): no I/O, clock,
  randomness or logging. The scraper is ``collectors.exporter``.
* Every malformed input raises ``collectors.errors.ParseError`` (one line), never another
  exception type. A chip whose series are partial, older than ``max_age_s`` or of an unknown
  health is never guessed at: it is listed in ``ExporterScrape.missing`` and left out of
  ``chips`` (the node's NPU sample is then missing, and the scheduler ages its NPU signal).

Source (Ascend/mind-cluster, ``component/npu-exporter``; docs/ascend.md has the table)
------------------------------------------------------------------------------------
* Per chip, labels ``id`` (the device id: the NPU id on one-chip NPUs, the ``Phy-ID`` /
  ``Device`` column of ``npu-smi info`` on two-chip NPUs such as Atlas A3 and 300I Duo),
  ``model_name``, ``v_dev_id``, ``pcie_bus_info``, and ``namespace``, ``pod_name``,
  ``container_name`` (empty unless a pod holds the chip) (``collector/common/common.go``
  ``CardLabel``). Older exporters label ``vdie_id`` instead of ``v_dev_id``; both are read.
* Gauges (``collector/metrics/collector_for_npu.go``, ``collector_for_hbm.go``):
  ``npu_chip_info_utilization`` (AI Core %), ``npu_chip_info_overall_utilization`` (NPU %,
  910B / A3 only), ``npu_chip_info_cube_utilization``, ``npu_chip_info_vector_utilization``,
  ``npu_chip_info_hbm_used_memory`` / ``npu_chip_info_hbm_total_memory`` (MB),
  ``npu_chip_info_hbm_utilization`` (%), ``npu_chip_info_health_status`` (1 healthy, 0
  unhealthy: the chip's DCMI health is not 0; other values: not known),
  ``npu_chip_info_network_status`` (same coding), ``npu_chip_info_temperature`` (C),
  ``npu_chip_info_power`` (W), ``npu_chip_info_aicore_current_freq`` (MHz),
  ``npu_chip_info_error_code`` and ``npu_chip_info_error_code_<n>`` (the chip's raw fault
  codes as decimal integers, 0 = none), ``machine_npu_nums``. 310P chips have DDR
  (``npu_chip_info_used_memory`` / ``npu_chip_info_total_memory``) instead of HBM.
* Every sample carries the time the exporter's cache was filled (it refreshes every
  ``-updateTime`` s, 5 by default): ``max_age_s`` against ``now_s`` finds a stale cache.

Health (``chip_health``): the worst of the health gauge (0 -> ``Alarm``), the network gauge
(0 -> ``Warning``) and the chip's fault codes through MindCluster's fault-level table
(``collectors.faultcodes``): the same words npu-smi prints, so the scheduler's phase rules
apply unchanged (Alarm drains, Critical ejects).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.samples import Sample

from laswrr.collectors.errors import ParseError
from laswrr.collectors.faultcodes import HEALTH_RANK, FaultTable, code_hex
from laswrr.collectors.prometheus import exposition_samples
from laswrr.schemas.events import NpuChip
from laswrr.schemas.words import NpuHealth

__all__ = ["ExporterChip", "ExporterScrape", "chip_health", "parse_exporter", "select_exporter_chips", "to_npu_chip"]

PREFIX = "npu_chip_info_"
_ERROR_CODE_RE = re.compile(r"^npu_chip_info_error_code(?:_(\d+))?$")
_GAUGES = {
    "utilization": "aicore_util", "overall_utilization": "overall_util", "cube_utilization": "cube_util",
    "vector_utilization": "vector_util", "hbm_used_memory": "hbm_used_mb", "hbm_total_memory": "hbm_total_mb",
    "hbm_utilization": "hbm_util", "used_memory": "memory_used_mb", "total_memory": "memory_total_mb",
    "health_status": "health_status", "network_status": "network_status", "temperature": "temp_c",
    "power": "power_w", "aicore_current_freq": "aicore_freq_mhz",
}
_PERCENT = {"aicore_util", "overall_util", "cube_util", "vector_util", "hbm_util"}
_MEGABYTES = {"hbm_used_mb", "hbm_total_mb", "memory_used_mb", "memory_total_mb"}


@dataclass(frozen=True)
class ExporterChip:
    """One chip of one exporter scrape. Utilisations are fractions 0..1; None = not exported."""

    id: int
    model_name: str = ""
    v_dev_id: str = ""
    pcie_bus_info: str = ""
    namespace: str = ""
    pod_name: str = ""
    container_name: str = ""
    aicore_util: float | None = None
    overall_util: float | None = None
    cube_util: float | None = None
    vector_util: float | None = None
    hbm_used_mb: int | None = None
    hbm_total_mb: int | None = None
    hbm_util: float | None = None
    memory_used_mb: int | None = None
    memory_total_mb: int | None = None
    health_status: int | None = None  # 1 healthy, 0 unhealthy, None not known
    network_status: int | None = None
    temp_c: float | None = None
    power_w: float | None = None
    aicore_freq_mhz: float | None = None
    error_codes: tuple[int, ...] = ()  # nonzero codes, in the order error_code, _1, _2, ...
    sampled_s: float | None = None  # the oldest sample time of this chip's series (exporter cache time)
    missing: str | None = None  # why this chip is not to be believed (stale cache, partial series); None: fine

    @property
    def util(self) -> float | None:
        """What the router reads as the chip's utilisation: NPU (overall) where exported, else AI Core."""
        return self.overall_util if self.overall_util is not None else self.aicore_util


@dataclass(frozen=True)
class ExporterScrape:
    chips: tuple[ExporterChip, ...]  # the chips to believe
    missing: tuple[str, ...] = ()  # chips left out, each with why ("id 3: stale (sampled 40 s ago)")
    npu_count: int | None = None  # machine_npu_nums
    truncated: bool = False
    all_chips: tuple[ExporterChip, ...] = ()  # chips and left-out chips (``missing`` set), by id


def _finite(sample: Sample) -> float:
    value = float(sample.value)
    if math.isnan(value) or math.isinf(value):
        raise ParseError(f"{sample.name}{dict(sample.labels)} = {value}: not a finite number")
    return value


def _chip_id(sample: Sample) -> int | None:
    raw = sample.labels.get("id")
    if raw is None:
        return None
    if not raw.isdigit() or len(raw) > 6:
        raise ParseError(f"{sample.name}: chip id label {raw!r} is not a device number")
    return int(raw)


_LABELS = ("model_name", "pcie_bus_info", "namespace", "pod_name", "container_name")


def _gauge_value(field: str, value: float, where: str) -> float | int | None:
    if field in _PERCENT:
        if not 0.0 <= value <= 100.0:
            return None  # the exporter's "could not read" values (-1, 0xFFFFFFFF) are not utilisation
        return round(value / 100.0, 6)
    if field in _MEGABYTES:
        return int(value) if 0 <= value < 2**53 else None
    if field in ("health_status", "network_status"):
        return int(value) if value in (0.0, 1.0) else None
    if field == "temp_c" and not -100.0 <= value <= 300.0:
        return None
    if field == "power_w" and not 0.0 <= value <= 10_000.0:
        return None
    if field == "aicore_freq_mhz" and not 0.0 <= value <= 100_000.0:
        return None
    return value


def parse_exporter(text: str, now_s: float | None = None, max_age_s: float | None = None) -> ExporterScrape:
    """The chips of one npu-exporter scrape. ``now_s`` and ``max_age_s`` (the caller's clock
    and its limit, seconds) leave out chips whose cache is older; without them no chip is stale.

    Raises ParseError for an empty body, text that is not an exposition, or one with no
    ``npu_chip_info_*`` series at all (an engine's /metrics given by mistake, an HTML page).
    """
    if not text.strip():
        raise ParseError("empty npu-exporter body")
    samples, truncated = exposition_samples(text)
    npu_count = None
    fields: dict[int, dict[str, object]] = {}
    codes: dict[int, dict[int, int]] = {}
    oldest: dict[int, float] = {}
    for sample in samples:
        if sample.name == "machine_npu_nums":
            count = _finite(sample)
            npu_count = int(count) if 0 <= count < 2**16 else None
            continue
        if not sample.name.startswith(PREFIX):
            continue
        chip = _chip_id(sample)
        if chip is None:
            continue
        value = _finite(sample)
        record = fields.setdefault(chip, {})
        for label in _LABELS:
            if sample.labels.get(label):
                record.setdefault(label, sample.labels[label])
        vdev = sample.labels.get("v_dev_id") or sample.labels.get("vdie_id")
        if vdev:
            record.setdefault("v_dev_id", vdev)
        if sample.timestamp is not None:
            stamp = float(sample.timestamp)
            oldest[chip] = min(stamp, oldest.get(chip, stamp))
        match = _ERROR_CODE_RE.match(sample.name)
        if match:
            if 0 < value < 2**63:
                codes.setdefault(chip, {})[int(match.group(1) or 0)] = int(value)
            continue
        field = _GAUGES.get(sample.name[len(PREFIX):])
        if field is not None:
            record[field] = _gauge_value(field, value, sample.name)
    if not fields:
        raise ParseError("no npu-exporter metrics: no npu_chip_info_* series with an id label")
    every = []
    for chip_id in sorted(fields):
        record = fields[chip_id]
        stamp = oldest.get(chip_id)
        why = None
        if now_s is not None and max_age_s is not None and stamp is not None and now_s - stamp > max_age_s:
            why = f"id {chip_id}: stale (sampled {now_s - stamp:.0f} s ago, limit {max_age_s:g} s)"
        elif "health_status" not in record:
            why = f"id {chip_id}: no npu_chip_info_health_status (partial scrape)"
        found = codes.get(chip_id, {})
        every.append(ExporterChip(id=chip_id, error_codes=tuple(found[i] for i in sorted(found)), sampled_s=stamp,
                                  missing=why, **record))  # type: ignore[arg-type]
    return ExporterScrape(chips=tuple(c for c in every if c.missing is None),
                          missing=tuple(c.missing for c in every if c.missing is not None), npu_count=npu_count,
                          truncated=truncated, all_chips=tuple(every))


def chip_health(chip: ExporterChip, table: FaultTable) -> tuple[str, str | None]:
    """``(health word, cause)`` of one chip: the worst of its health gauge, network gauge and
    fault codes (module doc). The cause names what set the word (None when OK)."""
    if chip.health_status is None:
        return NpuHealth.UNKNOWN, "health status not reported"
    findings: list[tuple[str, str]] = []
    if chip.health_status == 0:
        findings.append((NpuHealth.ALARM, "npu_chip_info_health_status 0 (unhealthy)"))
    if chip.network_status == 0:
        findings.append((NpuHealth.WARNING, "npu_chip_info_network_status 0 (network unhealthy)"))
    for code in chip.error_codes:
        level = table.level(code)
        findings.append((table.health(level), f"fault {code_hex(code)} {level}"))
    if not findings:
        return NpuHealth.OK, None
    worst = max(HEALTH_RANK[word] for word, _ in findings)
    word = next(word for word, _ in findings if HEALTH_RANK[word] == worst)
    causes = [cause for w, cause in findings if HEALTH_RANK[w] == worst]
    return word, "; ".join(causes)


def to_npu_chip(chip: ExporterChip, table: FaultTable, chips_per_npu: int = 1) -> NpuChip:
    """The ``NpuChip`` of a node's NPU sample: ``npu_id``/``chip_id`` from the device id
    (``id // chips_per_npu``, ``id % chips_per_npu``: two-chip NPUs number their dies 0..2n-1)."""
    word, cause = chip_health(chip, table)
    return NpuChip(
        npu_id=chip.id // chips_per_npu, chip_id=chip.id % chips_per_npu, aicore_util=chip.util,
        hbm_used_mb=chip.hbm_used_mb, hbm_total_mb=chip.hbm_total_mb, health=word, name=chip.model_name or None,
        power_w=chip.power_w, temp_c=chip.temp_c, memory_used_mb=chip.memory_used_mb,
        memory_total_mb=chip.memory_total_mb, fault=cause)


def select_exporter_chips(chips: Iterable[ExporterChip], npu_ids: Iterable[int], pairs: Iterable[tuple[int, int]],
                          pod: Mapping[str, str], chips_per_npu: int = 1) -> list[ExporterChip]:
    """The chips of one node: those whose NPU id (``id // chips_per_npu``) is in ``npu_ids`` or
    whose ``(npu_id, chip_id)`` is in ``pairs``, or whose pod labels match ``pod`` (every given
    label equal); nothing given: every chip."""
    ids, exact = set(npu_ids), set(pairs)
    wanted = [(k, v) for k, v in pod.items() if v]
    if not ids and not exact and not wanted:
        return list(chips)
    out = []
    for chip in chips:
        npu, die = chip.id // chips_per_npu, chip.id % chips_per_npu
        by_id = npu in ids or (npu, die) in exact
        by_pod = bool(wanted) and all(getattr(chip, key) == value for key, value in wanted)
        if by_id or by_pod:
            out.append(chip)
    return out
