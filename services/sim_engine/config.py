"""Configuration and run-time fault state of one simulated engine (plain data)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from laswrr.schemas.words import NodeRole, NpuHealth, PdProtocol
from laswrr.services.sim_engine.profiles import ChipProfile, get_profile

FailMode = Literal["none", "refuse", "http500", "cut_stream", "stall_stream"]
Flavour = Literal["vllm", "mindie"]
PD_ROLES: tuple[str, ...] = tuple(role.value for role in NodeRole)
PD_PROTOCOLS: tuple[str, ...] = tuple(protocol.value for protocol in PdProtocol)
# A P/D decode instance "transfers" a prompt's KV from its prefill instance at this rate (tokens/s,
# times --speed) before decoding it: ~ a 64 KB-per-token model's KV over a 25 GB/s link.
KV_TRANSFER_TOKENS_PER_S = 400_000.0
FLAVOURS: tuple[str, ...] = get_args(Flavour)
FAIL_MODES: tuple[str, ...] = get_args(FailMode)
# The chip healths POST /admin may set (npu-smi's words but UNKNOWN, which npu-smi prints for none).
HEALTH_STATES: tuple[NpuHealth, ...] = tuple(h for h in NpuHealth if h != NpuHealth.UNKNOWN)
# Chip health values for which the engine's own /health answers 503.
UNHEALTHY_STATES = frozenset({NpuHealth.ALARM, NpuHealth.CRITICAL})


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
    flavour: Flavour = "vllm"  # mindie: MindIE's /metrics names, /v1/status, /v2/status, /metrics-json
    exporter_update_s: float = 5.0  # the simulated npu-exporter's cache refresh (its -updateTime)
    pd_role: NodeRole = NodeRole.BOTH  # prefill/decode disaggregation (docs/proxy.md)
    pd_protocol: PdProtocol = PdProtocol.VLLM  # the P/D protocol a prefill or decode instance speaks
    pd_local_prefill: bool = False  # a vllm decode instance serves a request without kv_transfer_params whole
    bootstrap_port: int = 0  # an sglang prefill instance's bootstrap server port (required for one)
    bootstrap_timeout_s: float = 30.0  # sglang: a decode waits this long for its room, a prefill for its decode
    # the largest request body it reads: the proxy's --max-body-bytes default (4 MiB), so whatever the
    # proxy lets through reaches the engine (aiohttp's own default, 1 MiB, answered 413 below the proxy's limit)
    max_body_bytes: int = 4 * 1024 * 1024
    # the engine's KV cache events on vLLM's wire (kv_publisher.py): the PUB endpoint to bind, and the replay's
    kv_events: str | None = None
    kv_events_replay: str | None = None
    tokenizer: str | None = None  # the model's tokenizer directory: prompts cut into its tokens, as a real engine does

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
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")
        if not self.speed > 0:
            raise ValueError(f"--speed must be > 0, got {self.speed}")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError(f"--kv-tokens must be >= 1, got {self.kv_tokens}")
        if self.flavour not in FLAVOURS:
            raise ValueError(f"--flavour must be one of {', '.join(FLAVOURS)}, got {self.flavour!r}")
        if not 1.0 <= self.exporter_update_s <= 60.0:
            raise ValueError(f"--exporter-update-s must be within 1..60 (npu-exporter's -updateTime), "
                             f"got {self.exporter_update_s}")
        if self.pd_role not in PD_ROLES:
            raise ValueError(f"--pd-role must be one of {', '.join(PD_ROLES)}, got {self.pd_role!r}")
        if self.pd_protocol not in PD_PROTOCOLS:
            raise ValueError(f"--pd-protocol must be one of {', '.join(PD_PROTOCOLS)}, got {self.pd_protocol!r}")
        sglang_prefill = self.pd_role == NodeRole.PREFILL and self.pd_protocol == PdProtocol.SGLANG
        if sglang_prefill and not 1 <= self.bootstrap_port <= 65535:
            raise ValueError(f"an sglang prefill instance needs --bootstrap-port (1..65535), got {self.bootstrap_port}")
        if not sglang_prefill and self.bootstrap_port:
            raise ValueError("--bootstrap-port is only for --pd-role prefill --pd-protocol sglang")
        if self.pd_local_prefill and (self.pd_role, self.pd_protocol) != (NodeRole.DECODE, PdProtocol.VLLM):
            raise ValueError("--pd-local-prefill is only for --pd-role decode --pd-protocol vllm")
        if not self.bootstrap_timeout_s > 0:
            raise ValueError(f"--bootstrap-timeout-s must be > 0, got {self.bootstrap_timeout_s}")
        if self.tokenizer is not None and not (Path(self.tokenizer) / "tokenizer.json").is_file():
            raise ValueError(f"--tokenizer {self.tokenizer}: no tokenizer.json there")
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ValueError("--kv-events-replay needs --kv-events")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")


@dataclass(slots=True)
class FaultState:
    """What POST /admin can change besides capacity and slowdown (those live in the physics)."""

    fail: FailMode = "none"
    health: NpuHealth = NpuHealth.OK
    cut_after: int = 2  # tokens streamed before a cut_stream abort or a stall_stream stall
    fault_code: str = ""  # a MindCluster fault code (8 hex digits) its npu-exporter reports; "" none

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def endpoint_healthy(self) -> bool:
        """What GET /health reports (refuse never gets that far; cut_stream and stall_stream are silent faults)."""
        return self.fail != "http500" and self.health not in UNHEALTHY_STATES
