"""The data dir's lock (services/datadir_lock.py) with real processes: held by a live process it
refuses with that process's pid; left by a process killed with -9 it is taken over (the kernel
dropped the flock), whatever pid the stale file still names."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from laswrr.services.datadir_lock import LOCK_FILE, DataDirInUse, DataDirLock

HOLD = ("import sys, time; from laswrr.services.datadir_lock import DataDirLock; "
        "DataDirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)")


def _holder(data: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(data)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_holder_is_named_and_a_dead_ones_lock_is_taken_over(tmp_path: Path) -> None:
    data = tmp_path / "data"
    holder = _holder(data)
    try:
        with pytest.raises(DataDirInUse, match=f"data dir {data} in use by pid {holder.pid}"):
            DataDirLock(data).acquire()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    assert (data / LOCK_FILE).read_text().strip() == str(holder.pid)  # the stale file still names the dead pid
    lock = DataDirLock(data)
    lock.acquire()  # taken over: no error
    assert (data / LOCK_FILE).read_text().strip() == str(os.getpid())
    lock.release()
    again = DataDirLock(data)  # released: free for the next one
    again.acquire()
    again.release()


def test_the_lock_is_not_inherited_by_children(tmp_path: Path) -> None:
    """A child spawned while the lock is held (nats-server, the services) does not keep it alive
    after its parent is gone."""
    data = tmp_path / "data"
    lock = DataDirLock(data)
    lock.acquire()
    child = subprocess.Popen(["sleep", "600"], close_fds=False)  # even a child given every descriptor
    try:
        lock.release()
        other = DataDirLock(data)
        other.acquire()
        other.release()
    finally:
        child.kill()
        child.wait()
