"""Configuration and run-time fault state of one simulated engine (plain data)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from laswrr.services.sim_engine.profiles import ChipProfile, get_profile

FailMode = Literal["none", "refuse", "http500", "cut_stream", "stall_stream"]
Health = Literal["OK", "Warning", "Alarm", "Critical"]
FAIL_MODES: tuple[str, ...] = get_args(FailMode)
HEALTH_STATES: tuple[str, ...] = get_args(Health)
# Chip health values for which the engine's own /health answers 503.
UNHEALTHY_STATES = frozenset({"Alarm", "Critical"})


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Start-up settings (the `laswrr sim-engine` options)."""

    chip: str = "910B"
    capacity: int = 8
    host: str = "127.0.0.1"
    port: int = 0
    model: str | None = None  # default: sim-<chip>
    seed: int = 0
    node_id: str | None = None  # default: <chip>-<port>
    speed: float = 1.0
    kv_tokens: int | None = None  # default: the chip profile's KV room
    npu_id: int = 0

    @property
    def profile(self) -> ChipProfile:
        return get_profile(self.chip)

    @property
    def model_name(self) -> str:
        return self.model or f"sim-{self.profile.chip}"

    def validate(self) -> None:
        self.profile  # noqa: B018 - raises ValueError on an unknown chip
        if self.capacity < 0:
            raise ValueError(f"--capacity must be >= 0, got {self.capacity}")
        if not self.speed > 0:
            raise ValueError(f"--speed must be > 0, got {self.speed}")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError(f"--kv-tokens must be >= 1, got {self.kv_tokens}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")


@dataclass(slots=True)
class FaultState:
    """What POST /admin can change besides capacity and slowdown (those live in the physics)."""

    fail: FailMode = "none"
    health: Health = "OK"
    cut_after: int = 2  # tokens streamed before a cut_stream abort or a stall_stream stall

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def endpoint_healthy(self) -> bool:
        """What GET /health reports (refuse never gets that far; cut_stream and stall_stream are silent faults)."""
        return self.fail != "http500" and self.health not in UNHEALTHY_STATES
