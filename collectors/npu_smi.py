"""Pure parsers (and a renderer) for ``npu-smi`` text output.

Rules
-----
* Pure functions of ``str``: no I/O, clock, randomness, subprocess or logging here; the
  collector that runs ``npu-smi`` lives elsewhere. A purity test scans this module's imports.
* Every malformed input raises ``collectors.errors.ParseError`` with a one-line message;
  no other exception type escapes.
* A value the table does not have (``NA``, ``-``, no HBM column) becomes ``None``, never 0.

``npu-smi info`` summary table (``parse_info``), quirks handled (see
tests/fixtures/real/SOURCES.md):

* Layouts are told apart by the header rows, never by column width: 93 (narrow 910ProB),
  98 (910/910B*/A3), 104 (310P) and 116 (26.x wide) columns all parse the same way, by
  splitting rows on ``|`` and then on whitespace.
* Header row 2 is ``Chip`` (one chip id column), ``Chip  Phy-ID`` (Atlas A3: the Phy-ID is
  the global chip number) or ``Chip    Device`` (310P); the second id is checked but not kept
  (``NpuChip`` has no field for it); chips are keyed by ``(npu_id, chip_id)``.
* Row 1 of a chip = NPU, Name, Health, Power(W), Temp(C), Hugepages; row 2 = Chip[, Phy-ID
  |Device], Bus-Id, AICore(%), Memory-Usage(MB)[, HBM-Usage(MB)]. Multi-chip NPUs (A3,
  300I Duo) repeat row 1 per chip; A3 chip 1 prints power ``-``; 310P prints ``NA`` and has
  no HBM column (``hbm_*`` is None, device memory goes to ``memory_*``).
* ``a / b`` pairs are split on ``/``: 5-digit used values touch the slash (``62810/ 65536``).
* ``AICore(%)`` becomes ``aicore_util`` in 0..1 (divided by 100).
* NPU ids may start above 0 or have gaps (containers, 310P). Names are copied verbatim
  (``910B`` may be an old 910 Pro-B, ``Ascend910`` an A3; do not key families on them).
* Lines that are not table rows (``...`` elisions, prose around a paste) are skipped; the
  table may end without its closing separator or without the process table. Parsing stops
  at the process table (``Process id`` header or ``No running processes found``).
* A chip whose row 1 has no row 2 (paste cut mid-chip), a row with the wrong number of
  cells or a non-numeric value raises ``ParseError`` rather than yielding a half chip.

``npu-smi info -t usages|common|temp|power|board`` key/value views (``parse_kv``): lines
are ``<indent><key> : <value>``, indent a TAB in real output and spaces in pastes; split on
the FIRST ``:`` (Bus-Id values contain ``:``). Blocks are separated by blank lines (and a
repeated key starts a new block, for pastes that lost the blank lines). ``Chip ID`` is a
trailer in ``-t usages``/``power``/``temp`` but a header in ``-t common``; MCU blocks
(``Chip Name : mcu|MCU``) carry no Chip ID. ``kv_chip_metrics`` reads one chip's numbers
with the key-name variants of different drivers/products and prefers ``NPU
Utilization(%)`` over ``Aicore Usage Rate(%)`` for utilisation (docs/design.md, "Ascend-specific
signals and heterogeneous pools").
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from laswrr.collectors.errors import ParseError
from laswrr.schemas.events import NpuChip

__all__ = [
    "KvChipMetrics",
    "ParseError",
    "kv_chip_metrics",
    "parse_info",
    "parse_kv",
    "render_info",
]

_ABSENT = frozenset({"-", "NA", "N/A", "--"})
_INT_RE = re.compile(r"\d+")
_NUM_RE = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
_PAIR_TOKEN = r"(\d+|NA|N/A|-)"
_PAIR_RE = re.compile(_PAIR_TOKEN + r"\s*/\s*" + _PAIR_TOKEN)
_PAIRS_ONLY_RE = re.compile(r"\s*(?:" + _PAIR_TOKEN + r"\s*/\s*" + _PAIR_TOKEN + r"\s*)*")


# --------------------------------------------------------------------------- values


def _opt_float(token: str, what: str, where: str) -> float | None:
    if token in _ABSENT:
        return None
    if not _NUM_RE.fullmatch(token):
        raise ParseError(f"{where}: {what} {token!r} is not a number")
    return float(token)


def _opt_int(token: str, what: str, where: str) -> int | None:
    if token in _ABSENT:
        return None
    if not _INT_RE.fullmatch(token):
        raise ParseError(f"{where}: {what} {token!r} is not a non-negative integer")
    return int(token)


def _percent_to_fraction(value: float | None, what: str, where: str) -> float | None:
    if value is None:
        return None
    if not 0.0 <= value <= 100.0:
        raise ParseError(f"{where}: {what} {value:g} is outside 0..100 %")
    return value / 100.0


# --------------------------------------------------------------------------- info table


@dataclass(frozen=True)
class _Layout:
    second_id: str | None  # "Phy-ID" (A3), "Device" (310P) or None
    has_hbm: bool


@dataclass(frozen=True)
class _Row1:
    npu_id: int
    name: str
    health: str
    power_w: float | None
    temp_c: float | None
    where: str


def _cells(line: str) -> list[str]:
    body = line.strip()
    if body.endswith("|"):
        body = body[:-1]
    return [c.strip() for c in body[1:].split("|")]


def _is_process_section(line: str) -> bool:
    return "Process id" in line or "Process name" in line or "No running processes found" in line


def _header_layout(row2_cells: list[str], where: str) -> _Layout:
    if len(row2_cells) != 3:
        raise ParseError(f"{where}: header row 'Chip ...' has {len(row2_cells)} cells, expected 3")
    ids = row2_cells[0].split()
    second = ids[1] if len(ids) > 1 else None
    if second not in (None, "Phy-ID", "Device"):
        raise ParseError(f"{where}: unknown chip id column {second!r} in header (expected Phy-ID or Device)")
    value_headers = row2_cells[2].split()
    if not value_headers or value_headers[0] != "AICore(%)":
        raise ParseError(f"{where}: header row 'Chip ...' does not list AICore(%)")
    return _Layout(second_id=second, has_hbm="HBM-Usage(MB)" in value_headers)


def _parse_row1(cells: list[str], where: str) -> _Row1:
    ids = cells[0].split()
    if len(ids) != 2 or not _INT_RE.fullmatch(ids[0]):
        raise ParseError(f"{where}: expected 'NPU Name' in the first cell, got {cells[0]!r}")
    health = cells[1].split()
    if len(health) != 1:
        raise ParseError(f"{where}: expected one Health word, got {cells[1]!r}")
    values = cells[2].split()
    if len(values) < 2:
        raise ParseError(f"{where}: expected 'Power(W) Temp(C) ...', got {cells[2]!r}")
    return _Row1(
        npu_id=int(ids[0]),
        name=ids[1],
        health=health[0],
        power_w=_opt_float(values[0], "Power(W)", where),
        temp_c=_opt_float(values[1], "Temp(C)", where),
        where=where,
    )


def _parse_pairs(text: str, count: int, where: str) -> list[tuple[int | None, int | None]]:
    if not _PAIRS_ONLY_RE.fullmatch(text):
        raise ParseError(f"{where}: expected 'used / total' memory pairs, got {text.strip()!r}")
    pairs = _PAIR_RE.findall(text)
    if len(pairs) != count:
        raise ParseError(f"{where}: expected {count} 'used / total' pair(s), found {len(pairs)} in {text.strip()!r}")
    return [(_opt_int(u, "memory used", where), _opt_int(t, "memory total", where)) for u, t in pairs]


def _parse_row2(cells: list[str], layout: _Layout, row1: _Row1, where: str) -> NpuChip:
    ids = cells[0].split()
    expected_ids = 2 if layout.second_id else 1
    if len(ids) != expected_ids or not all(_INT_RE.fullmatch(t) for t in ids):
        raise ParseError(f"{where}: expected {expected_ids} chip id(s) in the first cell, got {cells[0]!r}")
    if not cells[1]:
        raise ParseError(f"{where}: empty Bus-Id cell")
    aicore_token, _, rest = cells[2].strip().partition(" ")
    aicore = _percent_to_fraction(_opt_float(aicore_token, "AICore(%)", where), "AICore", where)
    pairs = _parse_pairs(rest, 2 if layout.has_hbm else 1, where)
    memory_used, memory_total = pairs[0]
    hbm_used, hbm_total = pairs[1] if layout.has_hbm else (None, None)
    return NpuChip(
        npu_id=row1.npu_id,
        chip_id=int(ids[0]),
        aicore_util=aicore,
        hbm_used_mb=hbm_used,
        hbm_total_mb=hbm_total,
        health=row1.health,
        name=row1.name,
        power_w=row1.power_w,
        temp_c=row1.temp_c,
        memory_used_mb=memory_used,
        memory_total_mb=memory_total,
    )


def _is_row2(cells: list[str]) -> bool:
    ids = cells[0].split()
    return bool(ids) and all(_INT_RE.fullmatch(t) for t in ids)


def parse_info(text: str) -> list[NpuChip]:
    """Chips of an ``npu-smi info`` summary table, in table order.

    Raises ParseError for empty/garbage input, a table without header or chips, or a chip
    cut between its two rows.
    """
    if not text.strip():
        raise ParseError("empty npu-smi info output")
    layout: _Layout | None = None
    header1_seen = False
    pending: _Row1 | None = None
    chips: list[NpuChip] = []
    seen: set[tuple[int, int]] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        where = f"line {number}"
        if not line.lstrip().startswith("|"):
            continue  # separators, '...' elisions, prose around a paste
        if _is_process_section(line):
            break
        cells = _cells(line)
        first = cells[0].split()
        if len(cells) == 1:
            continue  # version banner
        if first[:1] == ["NPU"] and "Name" in first:
            header1_seen = True
            continue
        if first[:1] == ["Chip"]:
            layout = _header_layout(cells, where)
            continue
        if layout is None or not header1_seen:
            raise ParseError(f"{where}: table row before the 'NPU Name' / 'Chip' header rows")
        if len(cells) != 3:
            raise ParseError(f"{where}: expected 3 '|' cells in a chip row, got {len(cells)}")
        if _is_row2(cells):
            if pending is None:
                raise ParseError(f"{where}: 'Chip' row without its 'NPU Name' row above")
            chip = _parse_row2(cells, layout, pending, where)
            if (chip.npu_id, chip.chip_id) in seen:
                raise ParseError(f"{where}: NPU {chip.npu_id} chip {chip.chip_id} appears twice")
            seen.add((chip.npu_id, chip.chip_id))
            chips.append(chip)
            pending = None
        else:
            if pending is not None:
                raise ParseError(f"{pending.where}: NPU {pending.npu_id} row without its 'Chip' row")
            pending = _parse_row1(cells, where)
    if pending is not None:
        raise ParseError(f"{pending.where}: NPU {pending.npu_id} row without its 'Chip' row (table cut mid-chip?)")
    if layout is None:
        raise ParseError("no npu-smi info table header ('NPU Name' / 'Chip' rows) found")
    if not chips:
        raise ParseError("npu-smi info table has a header but no chip rows")
    return chips


# --------------------------------------------------------------------------- render

# The 98-column layout of the real 910B samples (npu-smi-info_910B3_driver24.1.0_loaded.txt).
_W1, _W2, _W3 = 27, 15, 52
_SEP_DASH = "+" + "-" * _W1 + "+" + "-" * _W2 + "+" + "-" * _W3 + "+"
_SEP_EQ = "+" + "=" * _W1 + "+" + "=" * _W2 + "+" + "=" * _W3 + "+"
_TOP = "+" + "-" * (_W1 + _W2 + _W3 + 2) + "+"
_HEADER1 = "| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|"
_HEADER2 = "| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |"
_PROC_HEADER = "| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |"


def _fmt_num(value: float | None) -> str:
    if value is None:
        return "NA"
    return f"{value:.1f}"


def _fmt_temp(value: float | None) -> str:
    if value is None:
        return "NA"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _fmt_pair(used: int | None, total: int | None) -> str:
    left = "NA" if used is None else str(used)
    right = "NA" if total is None else str(total)
    return f"{left:<5}/ {right}"


def _fmt_aicore(util: float | None) -> str:
    if util is None:
        return "NA"
    percent = util * 100.0
    rounded = round(percent)
    return str(rounded) if abs(percent - rounded) < 1e-9 else f"{percent:.1f}"


def _row(c1: str, c2: str, c3: str) -> str:
    return f"|{c1:<{_W1}}|{c2:<{_W2}}|{c3:<{_W3}}|"


def _chip_rows(chip: NpuChip, bus_id: str) -> list[str]:
    row1 = _row(
        f" {chip.npu_id:<6}{chip.name or 'NA'}",
        f" {chip.health or 'UNKNOWN'}",
        f" {_fmt_num(chip.power_w):<12}{_fmt_temp(chip.temp_c):<18}{_fmt_pair(0, 0)}",
    )
    row2 = _row(
        f" {chip.chip_id}",
        f" {bus_id}",
        f" {_fmt_aicore(chip.aicore_util):<12}"
        f"{_fmt_pair(chip.memory_used_mb, chip.memory_total_mb):<18}"
        f"{_fmt_pair(chip.hbm_used_mb, chip.hbm_total_mb)}",
    )
    return [row1, row2]


def _check_renderable(chip: NpuChip) -> None:
    for text, width in ((chip.name or "", 20), (chip.health or "", 13)):
        if len(text) > width or (text and len(text.split()) != 1) or text.isdigit():
            raise ValueError(f"cannot render {text!r}: must be one non-numeric word of at most {width} characters")


def render_info(
    chips: Sequence[NpuChip],
    *,
    version: str = "24.1.0",
    bus_ids: Iterable[str] | None = None,
    process_table: bool = True,
) -> str:
    """An ``npu-smi info`` table in the 98-column layout of the real 910B samples.

    One two-row block per chip (multi-chip NPUs repeat the NPU row, as A3 does). Values the
    chip does not have print as ``NA``; aicore_util prints as an integer percent when it is
    one (else one decimal), power with one decimal. ``parse_info`` reads the result back
    exactly for integer percents and one-decimal powers. ``bus_ids`` default to
    ``0000:<npu_id hex>:00.0``. With ``process_table`` an empty process section follows,
    as printed by an idle real npu-smi. Raises ValueError for a name/health that would break
    the layout (more than one word, too wide, or all digits, which would read as a chip row).
    A None name/health prints as ``NA``/``UNKNOWN`` and reads back as that string.
    """
    buses = list(bus_ids) if bus_ids is not None else [f"0000:{c.npu_id:02X}:00.0" for c in chips]
    if len(buses) != len(chips):
        raise ValueError(f"{len(buses)} bus ids for {len(chips)} chips")
    banner = f" npu-smi {version}".ljust(34) + f"Version: {version}"
    lines = [_TOP, f"|{banner:<{_W1 + _W2 + _W3 + 2}}|", _SEP_DASH, _HEADER1, _HEADER2, _SEP_EQ]
    for chip, bus in zip(chips, buses, strict=True):
        _check_renderable(chip)
        lines.extend(_chip_rows(chip, bus))
        lines.append(_SEP_EQ)
    if process_table:
        lines.extend([_SEP_DASH, _PROC_HEADER, _SEP_EQ])
        for npu_id in dict.fromkeys(c.npu_id for c in chips):
            lines.append(f"|{f' No running processes found in NPU {npu_id}':<{_W1 + _W2 + _W3 + 2}}|")
            lines.append(_SEP_EQ)
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- key/value views


def _kv_line(line: str, number: int) -> tuple[str, str]:
    key, sep, value = line.partition(":")
    if not sep or not key.strip():
        raise ParseError(f"line {number}: expected 'Key : value', got {line.strip()[:60]!r}")
    return key.strip(), value.strip()


def parse_kv(text: str) -> list[dict[str, str]]:
    """Blocks of an ``npu-smi info -t <type>`` view, in order; keys/values stripped.

    Split on the first ``:`` of each line; a blank line (or a key repeated inside the current
    block) starts a new block. Raises ParseError when the text is empty, has a non-blank
    line without ``:``, or has no ``NPU ID`` line (not an npu-smi view).
    """
    if not text.strip():
        raise ParseError("empty npu-smi key/value output")
    blocks: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            if current:
                blocks.append(current)
            current = {}
            continue
        key, value = _kv_line(line, number)
        if key in current:
            blocks.append(current)
            current = {}
        current[key] = value
    if current:
        blocks.append(current)
    if not any("NPU ID" in block for block in blocks):
        raise ParseError("not an npu-smi info -t view: no 'NPU ID' line")
    return blocks


@dataclass(frozen=True)
class KvChipMetrics:
    """One chip's numbers from ``npu-smi info -t usages|common|temp|power`` (None = absent).

    ``util`` is the utilisation to use: ``npu_util`` when the driver prints it, else
    ``aicore_util``. Fractions are 0..1.
    """

    npu_id: int
    chip_id: int | None
    util: float | None
    npu_util: float | None
    aicore_util: float | None
    hbm_usage: float | None
    hbm_total_mb: int | None
    memory_usage: float | None
    power_w: float | None
    temp_c: float | None


_KEYS_NPU_UTIL = ("NPU Utilization(%)",)
_KEYS_AICORE = ("Aicore Usage Rate(%)", "AICore Usage Rate(%)")
_KEYS_HBM_USAGE = ("HBM Usage Rate(%)",)
_KEYS_HBM_TOTAL = ("HBM Capacity(MB)",)
_KEYS_MEMORY_USAGE = ("Memory Usage Rate(%)", "DDR Usage Rate(%)")
_KEYS_POWER = ("NPU Real-time Power(W)", "Power Dissipation(W)", "Real-time Power(W)")
_KEYS_TEMP = ("NPU Temperature (C)", "NPU Temperature(C)", "Temperature(C)", "Temperature (C)")


def _is_mcu(block: dict[str, str]) -> bool:
    # A block with a Chip ID is a chip even if a paste without blank lines glued the MCU's
    # "Chip Name : mcu" onto it.
    return block.get("Chip Name", "").lower() == "mcu" and "Chip ID" not in block


def _first(fields: dict[str, str], keys: tuple[str, ...]) -> str | None:
    for key in keys:
        if key in fields:
            return fields[key]
    return None


def _kv_float(fields: dict[str, str], keys: tuple[str, ...], where: str) -> float | None:
    token = _first(fields, keys)
    return None if token is None else _opt_float(token, keys[0], where)


def _kv_percent(fields: dict[str, str], keys: tuple[str, ...], where: str) -> float | None:
    return _percent_to_fraction(_kv_float(fields, keys, where), keys[0], where)


def _select_chip_fields(blocks: list[dict[str, str]], chip_id: int) -> tuple[dict[str, str], int | None]:
    chip_blocks = [b for b in blocks if "Chip ID" in b and not _is_mcu(b)]
    npu_level = [b for b in blocks if "Chip ID" not in b and not _is_mcu(b)]
    fields: dict[str, str] = {}
    for block in npu_level:
        fields.update(block)
    if not chip_blocks:
        return fields, None
    matching = [b for b in chip_blocks if _opt_int(b["Chip ID"], "Chip ID", "npu-smi view") == chip_id]
    if not matching:
        present = ", ".join(b["Chip ID"] for b in chip_blocks)
        raise ParseError(f"no block for Chip ID {chip_id} (present: {present})")
    fields.update(matching[0])
    return fields, chip_id


def kv_chip_metrics(blocks: list[dict[str, str]], chip_id: int = 0) -> KvChipMetrics:
    """Utilisation, HBM, power and temperature of one chip from ``parse_kv`` blocks.

    Merges the NPU-level block(s) with the block whose ``Chip ID`` is ``chip_id``; MCU blocks
    (board sensors) are ignored. Views without any Chip ID (``-t board``) use the NPU-level
    block only. Raises ParseError for a missing chip or a non-numeric value.
    """
    fields, found_chip = _select_chip_fields(blocks, chip_id)
    where = f"npu-smi view, chip {chip_id}"
    npu_id = _opt_int(fields.get("NPU ID", "NA"), "NPU ID", where)
    if npu_id is None:
        raise ParseError("npu-smi view has no numeric 'NPU ID'")
    npu_util = _kv_percent(fields, _KEYS_NPU_UTIL, where)
    aicore = _kv_percent(fields, _KEYS_AICORE, where)
    hbm_total = _first(fields, _KEYS_HBM_TOTAL)
    return KvChipMetrics(
        npu_id=npu_id,
        chip_id=found_chip,
        util=npu_util if npu_util is not None else aicore,
        npu_util=npu_util,
        aicore_util=aicore,
        hbm_usage=_kv_percent(fields, _KEYS_HBM_USAGE, where),
        hbm_total_mb=None if hbm_total is None else _opt_int(hbm_total, "HBM Capacity(MB)", where),
        memory_usage=_kv_percent(fields, _KEYS_MEMORY_USAGE, where),
        power_w=_kv_float(fields, _KEYS_POWER, where),
        temp_c=_kv_float(fields, _KEYS_TEMP, where),
    )
