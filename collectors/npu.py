"""NPU poller: run an ``npu-smi info`` command line and split its chips among nodes.

Theory of operation
-------------------
* One host's ``npu-smi info`` lists every NPU of that host; several engine instances (nodes)
  may run on one host, each on some of its chips. The collector runs each DISTINCT command
  line once per interval and gives every node the chips its selector names
  (``ChipSelector``): explicit ``(npu_id, chip_id)`` pairs, whole NPU ids, or (no selector)
  every chip the command printed.
* ``run_npu_smi`` runs the command with ``asyncio.create_subprocess_exec`` (argv from
  ``shlex.split``, never a shell) in a session of its own, bounded by a timeout: on expiry the
  whole session is killed (a wrapper such as ``ssh host npu-smi`` or a script, and whatever it
  started, not only the direct child).
  Every failure (not found, not executable, timeout, non-zero exit, garbage output) raises
  ``NpuSmiError`` with a one-line reason and a short ``kind`` the caller counts; the parse
  itself is ``collectors.npu_smi.parse_info`` (pure).
* ``select_chips`` is pure: the same chips in, the same split out, in the command's order.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
from collections.abc import Sequence
from dataclasses import dataclass

from laswrr.collectors.errors import ParseError
from laswrr.collectors.npu_smi import parse_info
from laswrr.schemas.events import NpuChip

STDERR_CHARS = 200


class NpuSmiError(Exception):
    """The npu-smi command could not give a chip table; ``kind`` is a counter label."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class ChipSelector:
    """Which chips of a host's npu-smi table serve one node (both empty = all of them)."""

    npu_ids: tuple[int, ...] = ()
    chips: tuple[tuple[int, int], ...] = ()

    @property
    def selects_all(self) -> bool:
        return not self.npu_ids and not self.chips

    def wants(self, chip: NpuChip) -> bool:
        if self.selects_all:
            return True
        return chip.npu_id in self.npu_ids or (chip.npu_id, chip.chip_id) in self.chips

    def missing(self, chips: Sequence[NpuChip]) -> list[str]:
        """Selected NPU ids / chip pairs that the table did not list (for a warning)."""
        present = {(c.npu_id, c.chip_id) for c in chips}
        npus = {npu for npu, _ in present}
        gone = [f"npu {n}" for n in self.npu_ids if n not in npus]
        gone += [f"chip {n}/{c}" for n, c in self.chips if (n, c) not in present]
        return gone


def split_command(command: str) -> list[str]:
    """``shlex.split`` with a clear error (ValueError) for an empty or unbalanced line."""
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise ValueError(f"npu_smi {command!r}: {exc}") from None
    if not argv:
        raise ValueError("npu_smi must be a non-empty command line")
    return argv


def select_chips(chips: Sequence[NpuChip], selector: ChipSelector) -> list[NpuChip]:
    return [chip for chip in chips if selector.wants(chip)]


async def _communicate(proc: asyncio.subprocess.Process, timeout_s: float) -> tuple[bytes, bytes]:
    try:
        return await asyncio.wait_for(proc.communicate(), timeout_s)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: a wrapper's children die too
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise


async def run_npu_smi(argv: Sequence[str], timeout_s: float) -> list[NpuChip]:
    """Run one npu-smi command line and parse its ``npu-smi info`` table."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        raise NpuSmiError("not_runnable", f"cannot run {argv[0]!r}: {exc.strerror or exc}") from None
    try:
        stdout, stderr = await _communicate(proc, timeout_s)
    except asyncio.TimeoutError:
        raise NpuSmiError("timeout", f"no answer within {timeout_s * 1000:.0f} ms (killed)") from None
    if proc.returncode != 0:
        detail = " ".join(stderr.decode("utf-8", errors="replace").split())[:STDERR_CHARS]
        raise NpuSmiError("exit_status", f"exit status {proc.returncode}: {detail or '(no stderr)'}")
    try:
        return parse_info(stdout.decode("utf-8", errors="replace"))
    except ParseError as exc:
        raise NpuSmiError("garbage", f"output is not an npu-smi info table: {exc}") from None
