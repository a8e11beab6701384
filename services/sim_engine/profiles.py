"""Chip profiles for the simulated Ascend inference engine.

Models one engine instance (e.g. vLLM-Ascend serving a 7-8B BF16 model at TP1) on one
``npu-smi`` NPU id, after docs/ascend.md §3:

* decode speed is relative to a 910B3 (HBM bandwidth ratio), prefill speed relative to its
  FP16 peak; the 910B3 baseline anchors are TPOT ~32 ms at light load and TTFT ~0.3 s for a
  ~500-token prompt;
* KV room (tokens) = HBM x 0.9 - weights - workspace for Llama-3-8B BF16 (131 072 B/token);
* the npu-smi appearance (name shown, HBM per chip, chips per NPU, idle/loaded power and
  temperature) comes from the real fixtures in tests/fixtures/real.

Pure data: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

# 910B3 baseline anchors (docs/ascend.md §3): light-load TPOT, prefill rate and a fixed
# front-end cost (tokenise + schedule + detokenise) that together give TTFT 0.3-0.4 s.
BASE_TPOT_S = 0.032
BASE_PREFILL_TOKENS_PER_S = 4000.0
FRONTEND_OVERHEAD_S = 0.15
# TPOT multiplier at a full batch is 1 + TPOT_GROWTH (=> ~150 ms saturated on 910B).
TPOT_GROWTH = 4.0
# vLLM's gpu_memory_utilization default and the HBM the driver keeps on an idle chip.
HBM_PREALLOC_FRACTION = 0.9
HBM_IDLE_FLOOR_MB = 2850


@dataclass(frozen=True, slots=True)
class ChipProfile:
    """Everything the simulator needs to know about one chip type."""

    chip: str  # profile key used on the command line: 910, 910B, 910C, ...
    npu_name: str  # the Name column of `npu-smi info`
    decode_speed: float  # relative to 910B3; divides TPOT
    prefill_speed: float  # relative to 910B3; multiplies the prefill token rate
    hbm_mb_per_chip: int  # HBM-Usage total per chip (MB), as npu-smi prints it
    chips_per_npu: int  # 2 for an A3 NPU (two dies), else 1
    kv_tokens: int  # KV-cache room in tokens (8B BF16), whole NPU
    base_capacity: int  # suggested integer SWRR weight (docs/ascend.md §3)
    power_idle_w: float
    power_load_w: float
    temp_idle_c: float
    temp_load_c: float

    @property
    def hbm_mb_total(self) -> int:
        return self.hbm_mb_per_chip * self.chips_per_npu

    @property
    def a3_layout(self) -> bool:
        """True when npu-smi prints the A3 layout (Chip + Phy-ID, Name `Ascend910`)."""
        return self.npu_name == "Ascend910"


PROFILES: dict[str, ChipProfile] = {
    p.chip: p
    for p in (
        ChipProfile("910", "910ProB", 0.75, 0.89, 32768, 1, 82_000, 7, 76.0, 150.0, 38.0, 55.0),
        ChipProfile("910B", "910B3", 1.00, 1.00, 65536, 1, 294_000, 10, 90.0, 165.0, 36.0, 55.0),
        ChipProfile("910B4", "910B4", 0.50, 0.83, 32768, 1, 82_000, 5, 86.0, 140.0, 35.0, 50.0),
        ChipProfile("910C", "Ascend910", 2.00, 2.40, 65536, 2, 718_000, 20, 175.0, 300.0, 51.0, 62.0),
        ChipProfile("910C-die", "Ascend910", 1.05, 1.20, 65536, 1, 294_000, 10, 175.0, 240.0, 51.0, 60.0),
    )
}


def get_profile(chip: str) -> ChipProfile:
    """Look a profile up by key (case-insensitive); ValueError lists the valid keys."""
    for key, profile in PROFILES.items():
        if key.lower() == chip.lower():
            return profile
    raise ValueError(f"unknown chip {chip!r}; choose one of {', '.join(PROFILES)}")
