"""schemas.upcast: the one place where older contract versions are read (no upcaster in v1)."""

from __future__ import annotations

import pytest

from laswrr.schemas import upcast


def test_payloads_are_upcast_step_by_step_to_the_current_version(monkeypatch: pytest.MonkeyPatch) -> None:
    assert upcast._UPCASTERS == {}  # v1: nothing older to read, no shim anywhere
    monkeypatch.setattr(upcast, "_UPCASTERS", {})
    monkeypatch.setattr(upcast, "CONTRACT_VERSION", 3)

    @upcast.register("req.finished", 1)
    def rename(payload: upcast.Payload) -> upcast.Payload:  # v2 renamed "code" to "status"
        payload = dict(payload)
        payload["status"] = payload.pop("code")
        return payload

    @upcast.register("req.finished", 2)
    def default_outcome(payload: upcast.Payload) -> upcast.Payload:  # v3 made "outcome" required
        return {"outcome": "completed", **payload}

    v1 = {"request_id": "r1", "code": 200}
    assert upcast.upcast("req.finished", 1, v1) == {"outcome": "completed", "request_id": "r1", "status": 200}
    assert upcast.upcast("req.finished", 2, {"status": 502, "outcome": "upstream_error"}) == {
        "outcome": "upstream_error", "status": 502}
    assert upcast.upcast("req.finished", 3, v1) is v1  # current: unchanged
    with pytest.raises(upcast.UpcastError, match="no upcaster for req.started from contract v1"):
        upcast.upcast("req.started", 1, {})
    with pytest.raises(upcast.UpcastError, match="newer than this build"):
        upcast.upcast("req.finished", 4, {})
    with pytest.raises(upcast.UpcastError, match="already has an upcaster"):
        upcast.register("req.finished", 1)(rename)
    with pytest.raises(upcast.UpcastError):
        upcast.register("req.finished", 3)  # nothing upgrades the current version
