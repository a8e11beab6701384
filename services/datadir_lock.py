"""One stack per data directory: ``<data_dir>/up.lock``, an OS file lock held while a stack runs.

``laswrr up`` (``Stack.start_nats``) takes the lock before it touches anything in the data
directory (the JetStream store, ``secrets/``, ``nats-server.conf``, the DuckDB file); a second
``up`` on a directory in use is refused at once with the holder's pid. The lock is ``flock``'s:
the kernel drops it when its process dies however it dies (``kill -9`` included), so a lock file
left by a dead process is simply taken over; the pid written into the file is for the message
only, never trusted to decide.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "up.lock"


class DataDirInUse(RuntimeError):
    """Another live process holds the data directory's lock."""

    def __init__(self, data_dir: Path, pid: int | None) -> None:
        who = f"pid {pid}" if pid else "another process"
        super().__init__(f"data dir {data_dir} in use by {who} (a `laswrr up` running there; stop it first, "
                         f"or give this one another --data-dir)")
        self.pid = pid


class DataDirLock:
    """``acquire()`` or ``DataDirInUse``; ``release()`` (idempotent). Not inherited by children
    (the descriptor is close-on-exec), so the lock lives exactly as long as this process holds it."""

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            raise DataDirInUse(self.data_dir, pid) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        os.ftruncate(fd, 0)
        os.close(fd)  # closing the descriptor drops the flock


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or 0) or None
    except (OSError, ValueError):
        return None
