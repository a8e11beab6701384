"""A short way for tests to ask the admitter: ``admit(router, pool, ...)`` is the admission, or None."""

from __future__ import annotations

from collections.abc import Collection

from laswrr.scheduler.routing.prompt import RequestSize
from laswrr.scheduler.routing.router import AdmitRequest, Admission, Router
from laswrr.schemas.words import NodeRole


def admit(router: Router, pool: str, tried: Collection[str] = (), prompt: bytes = b"",
          size: RequestSize | None = None, limited: bool | None = None, reserve: float = 0.0,
          role: NodeRole | None = None) -> Admission | None:
    result = router.admitter.admit(AdmitRequest(pool, tried, prompt, size, limited, reserve, role))
    return result if isinstance(result, Admission) else None
