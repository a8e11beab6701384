"""The simulated engine's Ascend faces: MindIE's status endpoints and an npu-exporter for its chips.

MindIE flavour (``--flavour mindie``; docs/ascend.md)
* ``GET /v1/status`` and ``GET /v2/status``: MindIE Server's single-node form (the layout of
  tests/fixtures/ascend/mindie-status-v1_single-node.json), values from the engine's own
  state: ``availSlotsNum`` = slots - running (the engine's *current* slots: a silent slot loss
  shows here at once), ``runningRequestNum``, ``waitingRequestNum``, and the KV room in
  16-token blocks (``totalNpuBlockNums``, ``freeNpuBlockNums`` = ``availBlockNum``). ``/v2``
  adds the multi-node counts (``totalAvailNpuSlotsNum``, ...). ``roleStatus`` is RoleReady,
  ``currentRole`` none (PD-mixed). MindIE serves these on its management port (1026); the
  simulator serves them on its one port.
* ``GET /metrics-json``: ``TTFT`` and ``TBT`` means (ms) over the last 1000 requests, the
  waiting / processing counts and ``remainBlocks``.
* ``GET /metrics`` carries MindIE's unprefixed names (as with ``MIES_SERVICE_MONITOR_MODE=1``).

Simulated npu-exporter (``GET /sim/npu-exporter``, every flavour)
* The engine's chips as MindCluster's npu-exporter exports them (the label set and gauges of
  tests/fixtures/ascend/npu-exporter_910B3-8chip_pods_fault.txt): device id ``npu_id *
  chips_per_npu + chip``, pod labels ``default`` / the node id / ``engine``. Like the real
  exporter it serves a cache refreshed every ``exporter_update_s`` (5 s), with the cache time
  as each sample's timestamp.
* The health set by ``POST /admin`` maps to what the exporter would show: OK -> health 1, no
  code; Warning -> health 1 and a sub-health code (81078605); Alarm -> health 0 and a
  RestartBusiness code (8C204E00); Critical -> health 0 and a SeparateNPU code (80E18402)
  (codes from collectors/faultcodes.toml). ``POST /admin {"fault_code": "80E18402"}`` adds a code
  that only the exporter reports (the engine's own /health stays as it is): a chip fault that
  MindCluster sees before the engine does.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from laswrr.schemas.words import NpuHealth
from laswrr.services.sim_engine.physics import KV_BLOCK_TOKENS

TIMING_WINDOW = 1000  # MindIE's DYNAMIC_AVERAGE_WINDOW_SIZE default
FAULT_CODES: dict[str, tuple[int, ...]] = {NpuHealth.OK: (), NpuHealth.WARNING: (0x81078605,),
                                            NpuHealth.ALARM: (0x8C204E00,), NpuHealth.CRITICAL: (0x80E18402,)}


def blocks(kv_tokens_used: int, kv_tokens_total: int) -> tuple[int, int]:
    """(free, total) KV blocks of ``KV_BLOCK_TOKENS`` tokens."""
    total = kv_tokens_total // KV_BLOCK_TOKENS
    used = -(-kv_tokens_used // KV_BLOCK_TOKENS)
    return max(0, total - used), total


def status(state: dict[str, Any], v2: bool = False) -> dict[str, Any]:
    """The ``/v1/status`` (``v2``: ``/v2/status``) body for one ``/sim/state`` document."""
    free, total = blocks(int(state["kv_tokens_used"]), int(state["kv_tokens_total"]))
    slots = max(0, int(state["capacity"]) - int(state["running"]))
    resource: dict[str, Any] = {
        "availSlotsNum": slots, "availBlockNum": free, "waitingRequestNum": state["waiting"],
        "runningRequestNum": state["running"], "swappedRequestNum": 0, "freeNpuBlockNums": free,
        "freeCpuBlockNums": 0, "totalNpuBlockNums": total, "totalCpuBlockNums": 0}
    if v2:
        resource.update({"totalAvailNpuSlotsNum": slots, "totalAvailNpuBlockNum": free, "dpInstMap": {"0": free},
                         "maxAvailNpuBlockNum": free})
    return {"service": {"roleStatus": "RoleReady", "currentRole": "none"}, "resource": resource,
            "linkStatus": {"peers": []}}


@dataclass
class Timings:
    """TTFT and TBT of the last ``TIMING_WINDOW`` finished requests (ms), for /metrics-json."""

    ttft: deque[float] = field(default_factory=lambda: deque(maxlen=TIMING_WINDOW))
    tbt: deque[float] = field(default_factory=lambda: deque(maxlen=TIMING_WINDOW))

    def add(self, ttft_s: float | None, tbt_s: float | None) -> None:
        if ttft_s is not None:
            self.ttft.append(ttft_s * 1000.0)
        if tbt_s is not None:
            self.tbt.append(tbt_s * 1000.0)

    @staticmethod
    def _mean(values: deque[float]) -> int:
        return int(sum(values) / len(values)) if values else 0


def metrics_json(state: dict[str, Any], timings: Timings, instance: str) -> dict[str, Any]:
    free, _ = blocks(int(state["kv_tokens_used"]), int(state["kv_tokens_total"]))
    values = {"TTFT": timings._mean(timings.ttft), "TBT": timings._mean(timings.tbt),
              "waitingInferRequestNum": state["waiting"], "processingInferRequestNum": state["running"],
              "remainBlocks": free}
    return {"resultType": "vector", "result": [
        {"metric": [{"__name__": name, "job": "node", "instance": instance}], "value": str(value)}
        for name, value in values.items()]}


@dataclass
class ExporterCache:
    """The simulated npu-exporter's cache: the text it serves, rebuilt at most every ``update_s``."""

    update_s: float = 5.0
    text: str = ""
    filled_at: float = float("-inf")

    def due(self, now: float) -> bool:
        return now - self.filled_at >= self.update_s


def _labels(device: int, model: str, bus: str, pod: str) -> str:
    return (f'container_name="engine",id="{device}",model_name="{model}",namespace="default",'
            f'pcie_bus_info="{bus}",pod_name="{pod}",v_dev_id=""')


def exporter_text(state: dict[str, Any], npu_id: int, now_s: float | None = None) -> str:
    """npu-exporter text for the engine's chips at ``now_s`` (wall clock; the samples' timestamp)."""
    npu = state["npu"]
    chips = int(npu["chips"])
    stamp = int((time.time() if now_s is None else now_s) * 1000)
    health = str(state["health"])
    codes = FAULT_CODES.get(health, ())
    healthy = 1 if health in (NpuHealth.OK, NpuHealth.WARNING) else 0
    if state.get("fault_code"):  # POST /admin {"fault_code": ...}: a code only the exporter sees
        codes = (int(state["fault_code"], 16), *codes)
    rows: dict[str, list[str]] = {}
    for chip in range(chips):
        device = npu_id * chips + chip
        labels = _labels(device, str(npu["name"]), f"0000:{0xC1 + 2 * device:02X}:00.0", str(state["node_id"]))
        values = {
            "npu_chip_info_utilization": npu["aicore_pct"], "npu_chip_info_overall_utilization": npu["aicore_pct"],
            "npu_chip_info_hbm_used_memory": npu["hbm_used_mb"], "npu_chip_info_hbm_total_memory": npu["hbm_total_mb"],
            "npu_chip_info_health_status": healthy, "npu_chip_info_network_status": 1,
            "npu_chip_info_temperature": npu["temp_c"], "npu_chip_info_power": npu["power_w"] if chip == 0 else 0,
            "npu_chip_info_error_code": codes[0] if codes else 0,
        }
        for name, value in values.items():
            rows.setdefault(name, []).append(f"{name}{{{labels}}} {value} {stamp}")
    out = ["# HELP machine_npu_nums Amount of npu installed on the machine.", "# TYPE machine_npu_nums gauge",
           f"machine_npu_nums {chips}"]
    for name in sorted(rows):
        out += [f"# HELP {name} {name[len('npu_chip_info_'):].replace('_', ' ')}", f"# TYPE {name} gauge", *rows[name]]
    return "\n".join(out) + "\n"
