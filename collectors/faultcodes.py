"""MindCluster fault codes -> fault level -> the chip health word the scheduler acts on.

Pure: ``fault_table(text)`` parses the TOML text of ``collectors/faultcodes.toml`` (its source
and the policy are written in that file and in docs/ascend.md, "MindCluster fault codes"); reading the file
is the caller's (``collectors.exporter.load_fault_table``). A bad table raises ``ParseError``.

Health words are npu-smi's (``OK`` < ``Warning`` < ``Alarm`` < ``Critical`` < ``UNKNOWN``): the
scheduler drains a node on Alarm and ejects it on Critical or UNKNOWN (scheduler.core).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field

from laswrr.collectors.errors import ParseError
from laswrr.schemas.words import NPU_SEVERITY, NpuHealth

__all__ = ["HEALTH_RANK", "LEVELS", "FaultTable", "code_hex", "fault_table"]

HEALTH_RANK = NPU_SEVERITY  # npu-smi's health words, by severity (schemas.words.NpuHealth)
# MindCluster's handling levels, least to most severe (the order breaks ties for a code listed twice).
LEVELS = ("NotHandleFault", "SubHealthFault", "RestartRequest", "RestartBusiness", "PreSeparateNPU",
          "FreeRestartNPU", "RestartNPU", "SeparateNPU")
UNKNOWN_LEVEL = "unknown"


def code_hex(code: int) -> str:
    """A raw fault code as MindCluster writes it: 8 upper-case hex digits (0x80E18402 -> 80E18402)."""
    return f"{code & 0xFFFFFFFF:08X}" if code >= 0 else f"{code}"


@dataclass(frozen=True)
class FaultTable:
    levels: dict[str, str] = field(default_factory=dict)  # code (8 hex digits) -> level
    health_of: dict[str, str] = field(default_factory=dict)  # level -> health word

    def level(self, code: int) -> str:
        return self.levels.get(code_hex(code), UNKNOWN_LEVEL)

    def health(self, level: str) -> str:
        return self.health_of.get(level, self.health_of.get(UNKNOWN_LEVEL, NpuHealth.WARNING))


def fault_table(text: str) -> FaultTable:
    """The table of a faultcodes.toml text: ``[health]`` maps every level of ``LEVELS`` and
    ``unknown`` to a health word; ``[codes]`` lists hex codes per level."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ParseError(f"fault-code table is not valid TOML: {exc}") from None
    health, codes = document.get("health"), document.get("codes", {})
    if not isinstance(health, dict) or not isinstance(codes, dict):
        raise ParseError("fault-code table needs a [health] table and a [codes] table")
    for level in (*LEVELS, UNKNOWN_LEVEL):
        word = health.get(level)
        if word not in HEALTH_RANK:
            raise ParseError(f"fault-code table: [health] {level} must be one of {', '.join(HEALTH_RANK)}, got {word!r}")
    levels: dict[str, str] = {}
    for level, listed in codes.items():
        if level not in LEVELS:
            raise ParseError(f"fault-code table: unknown level {level!r} in [codes] (known: {', '.join(LEVELS)})")
        if not isinstance(listed, list):
            raise ParseError(f"fault-code table: [codes] {level} must be a list of hex strings")
        for raw in listed:
            try:
                code = code_hex(int(str(raw), 16))
            except ValueError:
                raise ParseError(f"fault-code table: [codes] {level}: {raw!r} is not a hex code") from None
            known = levels.get(code)
            if known is None or LEVELS.index(level) > LEVELS.index(known):
                levels[code] = level
    return FaultTable(levels=levels, health_of={k: str(v) for k, v in health.items()})
