"""Test helper: ``laswrr replay --db`` on a recorded log, run as an operator runs it (a child
process of the real command line), must say the log replays exactly.

``replay_exact(db)`` returns the command's summary (its first line, for a test's figures) and
fails the test with the command's output otherwise. The command would ask a running recorder
for a copy of a database it holds; the tests call this after the stack stopped, and point
``NATS_URL`` at a closed port, so it never reaches any other NATS server on the machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

IDENTICAL = "identical: every recorded output was reproduced byte for byte"


def replay_exact(db: Path, timeout_s: float = 180.0) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "LASWRR_"))}
    env["NATS_URL"] = "nats://127.0.0.1:1"
    proc = subprocess.run([sys.executable, "-m", "laswrr", "replay", "--db", str(db)], capture_output=True,
                          text=True, timeout=timeout_s, env=env)
    assert proc.returncode == 0 and IDENTICAL in proc.stdout, (
        f"laswrr replay --db {db} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout.splitlines()[0] if proc.stdout else ""
