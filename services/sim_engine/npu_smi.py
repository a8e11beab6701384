"""The simulated ``npu-smi info`` of a sim-engine's NPU.

Models what the real tool shows for a chip running vLLM-Ascend (docs/ascend.md §1; docs/design.md,
"Ascend-specific signals and heterogeneous pools"):

* HBM-Usage jumps to the idle floor + 90 % of HBM when the engine starts (pre-allocation) and
  stays flat whatever the load; with the engine down (fail=refuse) it falls to the floor;
* AICore(%) is 0 with an empty batch and rises from 10 % to ~40 % as the batch fills
  (decode is bandwidth-bound, so even a full batch shows low AICore);
* power and temperature move between the profile's idle and loaded values with the batch;
* Health is whatever POST /admin set.

``readings`` is pure (used by the engine's GET /sim/state); ``render`` builds the table with
``collectors.npu_smi.render_info`` so the project's parser reads it back (the engine serves it
as GET /sim/npu-smi, which ``curl`` can sample); ``run`` is the ``laswrr sim-npu-smi`` command
(fetches /sim/state with urllib).
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from laswrr.collectors.npu_smi import render_info
from laswrr.schemas.events import NpuChip
from laswrr.services.sim_engine.profiles import HBM_IDLE_FLOOR_MB, HBM_PREALLOC_FRACTION, ChipProfile

AICORE_BUSY_FLOOR_PCT = 10.0
AICORE_FULL_BATCH_PCT = 40.0


@dataclass(frozen=True, slots=True)
class NpuReadings:
    """Per-chip values an npu-smi sample would show (every chip of the NPU alike)."""

    aicore_pct: int
    hbm_used_mb: int  # per chip
    hbm_total_mb: int  # per chip
    power_w: float  # whole NPU
    temp_c: int


def batch_fill(running: int, capacity: int) -> float:
    """Fraction of the batch in use, 0..1 (a capacity-0 engine with work counts as full)."""
    if running <= 0:
        return 0.0
    return min(1.0, running / max(capacity, 1))


def readings(profile: ChipProfile, running: int, capacity: int, engine_up: bool) -> NpuReadings:
    fill = batch_fill(running, capacity) if engine_up else 0.0
    aicore = 0.0 if fill == 0 else AICORE_BUSY_FLOOR_PCT + (AICORE_FULL_BATCH_PCT - AICORE_BUSY_FLOOR_PCT) * fill
    hbm_used = HBM_IDLE_FLOOR_MB + (round(profile.hbm_mb_per_chip * HBM_PREALLOC_FRACTION) if engine_up else 0)
    power = profile.power_idle_w + (profile.power_load_w - profile.power_idle_w) * fill
    temp = profile.temp_idle_c + (profile.temp_load_c - profile.temp_idle_c) * fill
    return NpuReadings(round(aicore), hbm_used, profile.hbm_mb_per_chip, round(power, 1), round(temp))


def chips_from_state(state: dict[str, Any], npu_id: int) -> list[NpuChip]:
    """The NpuChip rows for one /sim/state document (A3 NPUs get two chips)."""
    npu = state["npu"]
    chips = []
    for chip_id in range(int(npu["chips"])):
        chips.append(
            NpuChip(
                npu_id=npu_id,
                chip_id=chip_id,
                name=str(npu["name"]),
                health=str(state["health"]),
                power_w=float(npu["power_w"]) if chip_id == 0 else None,  # A3: power on chip 0 only
                temp_c=float(npu["temp_c"]),
                aicore_util=int(npu["aicore_pct"]) / 100.0,
                memory_used_mb=0,
                memory_total_mb=0,
                hbm_used_mb=int(npu["hbm_used_mb"]),
                hbm_total_mb=int(npu["hbm_total_mb"]),
            )
        )
    return chips


def render(state: dict[str, Any], npu_id: int = 0) -> str:
    chips = chips_from_state(state, npu_id)
    buses = [f"0000:{0xC1 + 2 * c.chip_id:02X}:00.0" for c in chips]
    return render_info(chips, bus_ids=buses)


def fetch_state(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """GET <url>/sim/state; OSError/ValueError on any failure."""
    with urllib.request.urlopen(url.rstrip("/") + "/sim/state", timeout=timeout_s) as resp:
        state = json.loads(resp.read())
    if not isinstance(state, dict) or "npu" not in state:
        raise ValueError("response is not a sim-engine /sim/state document")
    return state


def run(url: str, npu_id: int) -> int:
    """The `laswrr sim-npu-smi` command body: print the table, or an error and exit 1."""
    try:
        state = fetch_state(url)
    except (OSError, ValueError, urllib.error.URLError) as exc:
        print(f"sim-npu-smi: cannot read engine state from {url}: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(render(state, npu_id))
    return 0
