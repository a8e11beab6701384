"""The recorder's disk fills up: it stops writing without corrupting its DuckDB file, acks
nothing it did not write (JetStream keeps the events), says so (an ERROR line and
``laswrr_recorder_write_failing`` 1, ``laswrr_recorder_write_failures`` counting), and once
space is freed it resumes: the log then has every event once, no hole, no duplicate.

Real parts: a tmpfs of a few MB mounted for the test (root only; skipped otherwise), a real
nats-server, ``laswrr recorder`` as a child process writing its DuckDB file there.
"""

from __future__ import annotations

import contextlib
import sys
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from laswrr.replay import store
from laswrr.schemas import subjects as sj
from laswrr.services.natsbus import connect, ensure_streams
from tests.conftest import wait_until
from tests.integration.test_recorder import ack_floor, stop, wait_acked

pytestmark = pytest.mark.timeout(180)
DISK = "6m"
PAYLOAD = b'{"request_id":"r%d","proxy":"p1","pad":"' + b"x" * 900 + b'"}'


@contextlib.contextmanager
def tmpfs(tmp_path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted under ``tmp_path`` (root only: the test skips with the reason otherwise)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path, DISK) as mount:
        yield mount


def fill(path: Path) -> int:
    """Write ``path`` until the filesystem is full; the bytes written."""
    written, block = 0, b"\0" * 65536
    # unbuffered: a buffered writer keeps what a partial write left and fails again on close
    with open(path, "wb", buffering=0) as sink:
        with contextlib.suppress(OSError):
            while step := sink.write(block):
                written += step
    return written


def start_recorder(url: str, data: Path, log_file: Path, *extra: str) -> subprocess.Popen[bytes]:
    """``laswrr recorder`` as a child process, its log off the small disk; once it records."""
    with open(log_file, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "laswrr", "recorder", "--nats-url", url,
                                 "--data-dir", str(data), *extra], stdout=subprocess.DEVNULL, stderr=log)
    proc.log_file = log_file  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while b" recording " not in log_file.read_bytes():
        assert proc.poll() is None, log_file.read_text()
        assert time.monotonic() < deadline, "recorder did not start"
        time.sleep(0.02)
    return proc


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def metric(http: aiohttp.ClientSession, port: int, name: str) -> float:
    async with http.get(f"http://127.0.0.1:{port}/metrics") as response:
        text = await response.text()
    for line in text.splitlines():
        if line.startswith(f'{name}{{stream="{sj.EVENTS_STREAM}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_full_disk_pauses_the_recorder_and_loses_nothing(nats_url: str, small_disk: Path,
                                                                tmp_path: Path) -> None:
    data = small_disk / "data"
    data.mkdir()
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    await ensure_streams(js)
    port = free_port()
    proc = start_recorder(nats_url, data, tmp_path / "recorder.log", "--batch", "200", "--flush-ms", "20", "--metrics-port", str(port))
    http = aiohttp.ClientSession()
    published = 0

    async def publish(n: int) -> None:
        nonlocal published
        for _ in range(n):
            published += 1
            await nc.publish(sj.req_started("n1"), PAYLOAD % published)
        await nc.flush()

    try:
        await publish(500)
        await wait_acked(js, sj.EVENTS_STREAM, "recorder-events", published)
        filler = small_disk / "filler"
        filled = fill(filler)
        before = published
        await publish(2000)
        await wait_until(lambda: metric(http, port, "laswrr_recorder_write_failing"), 60,
                         "the recorder to say it cannot write")

        async def retried() -> bool:
            return await metric(http, port, "laswrr_recorder_write_failures_total") >= 2

        await wait_until(retried, 60, "a second attempt, refused too")  # retried after 0.5 s, the disk still full
        floor_while_full = await ack_floor(js, sj.EVENTS_STREAM, "recorder-events")
        failures = await metric(http, port, "laswrr_recorder_write_failures_total")
        assert proc.poll() is None  # still running
        assert floor_while_full < published  # nothing acked that was not written
        filler.unlink()
        freed_at = time.monotonic()
        await wait_acked(js, sj.EVENTS_STREAM, "recorder-events", published, timeout=60)
        resumed_s = time.monotonic() - freed_at
        assert await metric(http, port, "laswrr_recorder_write_failing") == 0
    finally:
        await http.close()
        code = stop(proc)
        await nc.close()
    log = proc.log_file.read_text()  # type: ignore[attr-defined]
    with store.open_read(data / store.DB_FILE) as con:
        count, distinct, top = con.execute(
            "SELECT count(*), count(DISTINCT seq), max(seq) FROM events WHERE stream = ?", [sj.EVENTS_STREAM]).fetchone()
        check = con.execute("PRAGMA database_size").fetchall()
    print(f"FAULT full disk ({DISK} tmpfs, filler {filled} B): {published - before} events published while full, "
          f"acked through seq {floor_while_full} of {published} then, {failures:g} commits refused; resumed "
          f"{resumed_s:.2f} s after the space was freed; recorded {count} rows ({distinct} distinct, max seq {top}); "
          f"exit {code}")
    assert "cannot write to" in log and "again after" in log, log[-2000:]
    assert failures >= 2
    assert (count, distinct, top) == (published, published, published)  # no hole, no duplicate
    assert check and code == 0
