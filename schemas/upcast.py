"""The one place where a payload of an older wire-contract version becomes the current one.

The contract is version ``CONTRACT_VERSION`` (docs/wire.md): every struct of
``schemas.events`` and ``schemas.outputs`` is read as written there, and no reader anywhere
else keeps an older form readable. When a later version changes a payload in a way an old
reader cannot take (a renamed or retyped field, a split kind), it registers here one upcaster
per (kind, version it upgrades from): a pure function from the payload as that version wrote it
(decoded JSON) to the payload as the next version writes it. ``upcast`` chains them up to the
current version; readers of recorded logs call it before decoding with the structs. Version 1
has no upcaster: there is nothing older to read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CONTRACT_VERSION = 1

Payload = dict[str, Any]
Upcaster = Callable[[Payload], Payload]

_UPCASTERS: dict[tuple[str, int], Upcaster] = {}


class UpcastError(ValueError):
    """A payload of a version this build cannot bring to the current one."""


def register(kind: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    """Decorator: ``fn`` turns a ``kind`` payload of ``from_version`` into ``from_version + 1``."""
    if not 1 <= from_version < CONTRACT_VERSION:
        raise UpcastError(f"an upcaster upgrades a version below {CONTRACT_VERSION}, got {from_version}")

    def add(fn: Upcaster) -> Upcaster:
        if (kind, from_version) in _UPCASTERS:
            raise UpcastError(f"{kind} v{from_version} already has an upcaster")
        _UPCASTERS[(kind, from_version)] = fn
        return fn

    return add


def upcast(kind: str, version: int, payload: Payload) -> Payload:
    """``payload`` (a ``kind`` written by contract ``version``) as the current contract writes it."""
    current = CONTRACT_VERSION
    if version > current:
        raise UpcastError(f"{kind} of contract v{version} is newer than this build's v{current}")
    while version < current:
        step = _UPCASTERS.get((kind, version))
        if step is None:
            raise UpcastError(f"no upcaster for {kind} from contract v{version} to v{version + 1}")
        payload, version = step(payload), version + 1
    return payload
