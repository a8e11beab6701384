"""API keys on the proxy: who may send requests, under which name, and how many at once.

Rules:

* The keys file (``--api-keys FILE``, ``$LASWRR_API_KEYS_FILE``) holds one key per line,
  optionally ``name:key``; blank lines and ``#`` comments are skipped. A key without a name is
  called ``key-<line number>``. Names label ``/metrics`` and ``lb.req.started.key_name``, so
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

BEARER = "bearer "


class KeysFileError(ValueError):
    """The keys file cannot be used; the message names the file and line (never a key)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str, source: str = "keys file") -> list[tuple[str, bytes]]:
    """``(name, sha256(key))`` per key line of ``text``."""
    entries: list[tuple[str, bytes]] = []
    names: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, colon, key = line.partition(":")
        name, key = (name.strip(), key.strip()) if colon else (f"key-{number}", line)
        if not key or any(c.isspace() for c in key):
            raise KeysFileError(f"{source} line {number}: a key must be one word (name:key or key)")
        if not name or any(c.isspace() for c in name) or name in names:
            raise KeysFileError(f"{source} line {number}: the name must be one word, used once")
        names.add(name)
        entries.append((name, _digest(key)))
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

    @classmethod
    def load(cls, path: str | Path, max_inflight: int | None = None) -> "ApiKeys":
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise KeysFileError(f"cannot read the keys file {path}: {exc.strerror}") from None
        return cls(parse_keys(text, str(path)), max_inflight)

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
