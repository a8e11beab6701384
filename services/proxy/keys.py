"""API keys on the proxy: who may send requests, under which name, and how many at once.

Rules:

* The keys file (``--api-keys FILE``, ``$LASWRR_API_KEYS_FILE``) holds one key per line,
  optionally ``name:key``; blank lines and ``#`` comments are skipped. A key without a name is
  called ``key-<line number>``. After the key, optional flow-control fields, each
  ``field=value`` separated by spaces (a key is one word, so a file of plain ``name:key`` lines
  reads as before): ``max_priority=interactive|default|batch`` (the most urgent band the key's
  requests get, whatever their ``x-laswrr-priority`` says; default: every band), ``rpm=N`` and
  ``tpm=N`` (requests and tokens per minute; ``scheduler.routing.flow.RateLimits``; default: no
  limit). An unknown field or a bad value is an error naming the line. Names label ``/metrics`` and ``lb.req.started.key_name``, so
  analysts see usage per key; the key itself is never logged, published or exported.
* A request must carry ``Authorization: Bearer <key>``. The presented key is hashed (SHA-256)
  and compared with every known key's hash by ``hmac.compare_digest``, all of them, so the
  time taken says nothing about which key or how much of one matched. No key, or an unknown
  one: 401 ``invalid_api_key``.
* ``--key-max-inflight N``: a key with N requests in flight gets 429 ``rate_limited`` with
  ``Retry-After: 1`` for the next one, until one finishes.
* Engines never see the client's key: the ``Authorization`` header is dropped before
  forwarding unless ``--forward-authorization``; ``--upstream-api-key`` (or
  ``$LASWRR_UPSTREAM_API_KEY``) sends ``Authorization: Bearer <that key>`` to every engine.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from pathlib import Path

from multidict import CIMultiDict

from laswrr.scheduler.routing.flow import KeyLimits
from laswrr.schemas.words import Band

BEARER = "bearer "
NO_LIMITS = KeyLimits()


class KeysFileError(ValueError):
    """The keys file cannot be used; the message names the file and line (never a key)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str, source: str = "keys file") -> list[tuple[str, bytes]]:
    """``(name, sha256(key))`` per key line of ``text``."""
    return [(name, digest) for name, digest, _ in parse_key_lines(text, source)]


def _limits(fields: list[str], where: str) -> KeyLimits:
    values: dict[str, str] = {}
    for item in fields:
        field_name, equals, value = item.partition("=")
        if not equals or field_name not in ("max_priority", "rpm", "tpm") or field_name in values:
            raise KeysFileError(f"{where}: a key must be one word (name:key or key), then optional fields "
                                f"max_priority=, rpm=, tpm=, each once (not {item[:40]!r})")
        values[field_name] = value
    band = Band.INTERACTIVE
    if "max_priority" in values:
        try:
            band = Band(values["max_priority"])
        except ValueError:
            raise KeysFileError(f"{where}: max_priority must be one of {', '.join(Band)}") from None
    rates: dict[str, int | None] = {"rpm": None, "tpm": None}
    for field_name in rates:
        if field_name in values:
            if not values[field_name].isdigit() or int(values[field_name]) < 1:
                raise KeysFileError(f"{where}: {field_name} must be a positive integer")
            rates[field_name] = int(values[field_name])
    return KeyLimits(max_band=band, rpm=rates["rpm"], tpm=rates["tpm"])


def parse_key_lines(text: str, source: str = "keys file") -> list[tuple[str, bytes, KeyLimits]]:
    """``(name, sha256(key), its flow-control fields)`` per key line of ``text``."""
    entries: list[tuple[str, bytes, KeyLimits]] = []
    names: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, colon, rest = line.partition(":")
        name, rest = (name.strip(), rest.strip()) if colon else (f"key-{number}", line)
        key, *fields = rest.split() or [""]
        limits = _limits(fields, f"{source} line {number}")
        if not key or any(c.isspace() for c in key):
            raise KeysFileError(f"{source} line {number}: a key must be one word (name:key or key)")
        if not name or any(c.isspace() for c in name) or name in names:
            raise KeysFileError(f"{source} line {number}: the name must be one word, used once")
        names.add(name)
        entries.append((name, _digest(key), limits))
    if not entries:
        raise KeysFileError(f"{source} holds no key")
    return entries


def keys_file_problem(path: str | Path) -> str | None:
    """Why the keys file at ``path`` cannot be used (unreadable, malformed), or None: for a
    command to refuse it before it starts anything."""
    try:
        ApiKeys.load(path)
    except KeysFileError as exc:
        return str(exc)
    return None


@dataclass
class ApiKeys:
    """The known keys and each one's requests in flight."""

    entries: list[tuple[str, bytes]]
    max_inflight: int | None = None
    inflight: dict[str, int] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)
    limits: dict[str, KeyLimits] = field(default_factory=dict)  # name -> its flow-control fields, when any

    @classmethod
    def load(cls, path: str | Path, max_inflight: int | None = None) -> "ApiKeys":
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise KeysFileError(f"cannot read the keys file {path}: {exc.strerror}") from None
        lines = parse_key_lines(text, str(path))
        return cls([(name, digest) for name, digest, _ in lines], max_inflight,
                   limits={name: limits for name, _, limits in lines if limits != KeyLimits()})

    def limits_of(self, name: str | None) -> KeyLimits:
        return self.limits.get(name, NO_LIMITS) if name is not None else NO_LIMITS

    def identify(self, authorization: str | None) -> str | None:
        """The name of the key in ``Authorization: Bearer <key>``, or None."""
        if not authorization or not authorization[:len(BEARER)].lower() == BEARER:
            return None
        try:
            presented = _digest(authorization[len(BEARER):].strip())
        except UnicodeEncodeError:  # bytes that are not UTF-8 (kept as surrogates): no key is such
            return None
        found = None
        for name, digest in self.entries:  # every entry, match or not (module header)
            if hmac.compare_digest(presented, digest):
                found = name
        return found

    def acquire(self, name: str) -> bool:
        """Count one more request for ``name``; False (nothing counted) when at its limit."""
        current = self.inflight.get(name, 0)
        if self.max_inflight is not None and current >= self.max_inflight:
            return False
        self.inflight[name] = current + 1
        self.requests[name] = self.requests.get(name, 0) + 1
        return True

    def release(self, name: str) -> None:
        self.inflight[name] -= 1


@dataclass(frozen=True)
class UpstreamAuth:
    """What engines get in ``Authorization`` (module header)."""

    forward_client: bool = False
    api_key: str | None = None

    def apply(self, headers: CIMultiDict[str]) -> None:
        if not self.forward_client:
            headers.popall("Authorization", None)
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
