"""parse_info / render_info against every real `npu-smi info` table in tests/fixtures/real.

Expected values were read off the fixture files by eye (not snapshotted from the parser).
Tuple order: (npu_id, chip_id, name, health, power_w, temp_c, aicore_util,
hbm_used_mb, hbm_total_mb, memory_used_mb, memory_total_mb).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laswrr.collectors.errors import ParseError
from laswrr.collectors.npu_smi import parse_info, render_info
from laswrr.schemas.events import NpuChip

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real"

Row = tuple[int, int, str, str, float | None, float | None, float | None, int | None, int | None, int | None, int | None]

# file -> (chip count, {index: expected row})
EXPECTED: dict[str, tuple[int, dict[int, Row]]] = {
    "npu-smi-info_910ProB_driver23.0.rc1_single.txt": (
        1,
        {0: (2, 0, "910ProB", "OK", 81.1, 39.0, 0.0, 1, 32768, 2322, 15137)},
    ),
    "npu-smi-info_910B1_driver23.0.rc2_elided.txt": (
        3,
        {
            0: (0, 0, "910B1", "OK", 88.4, 46.0, 0.0, 4175, 65536, 0, 0),
            1: (1, 0, "910B1", "OK", 92.1, 47.0, 0.0, 4175, 65536, 0, 0),
            2: (7, 0, "910B1", "OK", 92.7, 48.0, 0.0, 4174, 65536, 0, 0),
        },
    ),
    "npu-smi-info_910B2_driver23.0.7.txt": (
        8,
        {
            0: (0, 0, "910B2", "OK", 96.5, 36.0, 0.0, 29954, 65536, 0, 0),
            3: (3, 0, "910B2", "OK", 91.5, 38.0, 0.0, 29951, 65536, 0, 0),
            4: (4, 0, "910B2", "OK", 96.6, 36.0, 0.0, 3347, 65536, 0, 0),
            7: (7, 0, "910B2", "OK", 93.8, 37.0, 0.0, 3347, 65536, 0, 0),
        },
    ),
    "npu-smi-info_910B4_driver24.1.rc3.txt": (
        8,
        {
            0: (0, 0, "910B4", "OK", 88.2, 36.0, 0.0, 2825, 32768, 0, 0),
            4: (4, 0, "910B4", "OK", 88.8, 34.0, 0.0, 31859, 32768, 0, 0),
            7: (7, 0, "910B4", "OK", 86.3, 36.0, 0.0, 2830, 32768, 0, 0),
        },
    ),
    "npu-smi-info_910ProB_driver24.1.0.txt": (
        8,
        {
            0: (0, 0, "910ProB", "OK", 78.0, 38.0, 0.0, 18, 32768, 2387, 13553),
            1: (1, 0, "910ProB", "OK", 75.8, 38.0, 0.0, 8, 32768, 1840, 15665),
            6: (6, 0, "910ProB", "OK", 83.0, 40.0, 0.0, 3, 32768, 2143, 15665),
            7: (7, 0, "910ProB", "OK", 77.3, 38.0, 0.0, 2, 32768, 2088, 15567),
        },
    ),
    "npu-smi-info_910A-named-910B_driver24.1.0.txt": (
        8,
        {
            0: (0, 0, "910B", "OK", 70.0, 34.0, 0.0, 1365, 32768, 1197, 13553),
            3: (3, 0, "910B", "OK", 67.2, 33.0, 0.0, 3, 32768, 2472, 15567),
            7: (7, 0, "910B", "OK", 65.6, 33.0, 0.0, 4, 32768, 1777, 15567),
        },
    ),
    "npu-smi-info_910B3_driver24.1.0_loaded.txt": (
        8,
        {
            0: (0, 0, "910B3", "OK", 153.7, 45.0, 0.39, 62810, 65536, 0, 0),
            2: (2, 0, "910B3", "OK", 144.7, 43.0, 0.38, 62697, 65536, 0, 0),
            7: (7, 0, "910B3", "OK", 167.5, 67.0, 0.34, 62698, 65536, 0, 0),
        },
    ),
    "npu-smi-info_A3-Ascend910_driver25.2.3_loaded.txt": (
        16,
        {
            0: (0, 0, "Ascend910", "OK", 232.5, 52.0, 0.17, 53444, 65536, 0, 0),
            1: (0, 1, "Ascend910", "OK", None, 51.0, 0.17, 52948, 65536, 0, 0),
            4: (2, 0, "Ascend910", "OK", 175.3, 52.0, 0.0, 3128, 65536, 0, 0),
            5: (2, 1, "Ascend910", "OK", None, 52.0, 0.0, 2888, 65536, 0, 0),
            12: (6, 0, "Ascend910", "OK", 243.3, 53.0, 0.17, 50719, 65536, 0, 0),
            15: (7, 1, "Ascend910", "OK", None, 52.0, 0.17, 50242, 65536, 0, 0),
        },
    ),
    "npu-smi-info_910B4-1_driver25.2.0_anonymized_cut.txt": (
        2,
        {
            0: (0, 0, "910B4-1", "OK", 91.3, 33.0, 0.0, 3197, 65536, 0, 0),
            1: (1, 0, "910B4-1", "OK", 88.1, 32.0, 0.0, 3197, 65536, 0, 0),
        },
    ),
    "npu-smi-info_310P3-300IDuo_driver25.0.rc1.txt": (
        8,
        {
            0: (1, 0, "310P3", "OK", None, 52.0, 0.0, None, None, 1607, 47304),
            1: (1, 1, "310P3", "OK", None, 50.0, 0.0, None, None, 1379, 46717),
            4: (4, 0, "310P3", "Critical", None, 56.0, 0.0, None, None, 1793, 44280),
            5: (4, 1, "310P3", "OK", None, 54.0, 0.0, None, None, 1162, 43693),
            7: (5, 1, "310P3", "OK", None, 56.0, 0.0, None, None, 1292, 43693),
        },
    ),
    "npu-smi-info_910B4_driver26.0.rc1_wide.txt": (
        1,
        {0: (0, 0, "910B4", "OK", 82.6, 32.0, 0.0, 2871, 32768, 0, 0)},
    ),
}


def _row(chip: NpuChip) -> Row:
    return (
        chip.npu_id,
        chip.chip_id,
        chip.name or "",
        chip.health or "",
        chip.power_w,
        chip.temp_c,
        chip.aicore_util,
        chip.hbm_used_mb,
        chip.hbm_total_mb,
        chip.memory_used_mb,
        chip.memory_total_mb,
    )


def _read(name: str) -> str:
    return (REAL / name).read_text(encoding="utf-8")


def test_every_info_fixture_is_covered() -> None:
    on_disk = {p.name for p in REAL.glob("npu-smi-info_*.txt")}
    assert on_disk == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_values(name: str) -> None:
    count, rows = EXPECTED[name]
    chips = parse_info(_read(name))
    assert len(chips) == count
    for index, expected in rows.items():
        assert _row(chips[index]) == pytest.approx(expected), f"{name} chip #{index}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_chip_keys_unique_and_fractions_in_range(name: str) -> None:
    chips = parse_info(_read(name))
    assert len({(c.npu_id, c.chip_id) for c in chips}) == len(chips)
    assert all(c.aicore_util is None or 0.0 <= c.aicore_util <= 1.0 for c in chips)


def test_310p_ids_have_gaps_and_two_chips_per_card() -> None:
    chips = parse_info(_read("npu-smi-info_310P3-300IDuo_driver25.0.rc1.txt"))
    assert [(c.npu_id, c.chip_id) for c in chips] == [(1, 0), (1, 1), (2, 0), (2, 1), (4, 0), (4, 1), (5, 0), (5, 1)]
    assert [c.health for c in chips].count("Critical") == 1


def test_a3_power_only_on_chip_0() -> None:
    chips = parse_info(_read("npu-smi-info_A3-Ascend910_driver25.2.3_loaded.txt"))
    assert [(c.npu_id, c.chip_id) for c in chips] == [(n, c) for n in range(8) for c in (0, 1)]
    assert all((c.power_w is None) == (c.chip_id == 1) for c in chips)


def test_elided_paste_keeps_the_visible_npus() -> None:
    chips = parse_info(_read("npu-smi-info_910B1_driver23.0.rc2_elided.txt"))
    assert [c.npu_id for c in chips] == [0, 1, 7]


def test_process_table_is_not_read_as_chips() -> None:
    # 910B3 has 8 process rows on NPU 0 whose first cells ("0       0") look like chip rows.
    assert len(parse_info(_read("npu-smi-info_910B3_driver24.1.0_loaded.txt"))) == 8


def test_prose_around_a_paste_is_ignored() -> None:
    text = "$ npu-smi info\n" + _read("npu-smi-info_910B4_driver26.0.rc1_wide.txt") + "\n[root@host ~]#\n"
    assert len(parse_info(text)) == 1


def test_crlf_line_endings() -> None:
    text = _read("npu-smi-info_910B2_driver23.0.7.txt").replace("\n", "\r\n")
    assert len(parse_info(text)) == 8


# ------------------------------------------------------------------ bad input

HEADER = "\n".join(_read("npu-smi-info_910B3_driver24.1.0_loaded.txt").splitlines()[:6]) + "\n"
ROW1 = "| 0     910B3               | OK            | 153.7       45                0    / 0             |\n"
ROW2 = "| 0                         | 0000:C1:00.0  | 39          0    / 0          62810/ 65536         |\n"


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param("   \n\t\n", id="whitespace"),
        pytest.param("hello world\nthis is not npu-smi\n", id="garbage"),
        pytest.param("\x00\x8f\xff\x13binary\x07\x1b[0m|||\n" * 5, id="binary-noise"),
        pytest.param(HEADER, id="header-only-half-table"),
        pytest.param(HEADER + ROW1, id="row1-without-row2"),
        pytest.param(HEADER + ROW2, id="row2-without-row1"),
        pytest.param(HEADER + ROW1 + ROW2[:60] + "\n", id="cut-mid-row"),
        pytest.param(ROW1 + ROW2, id="rows-without-header"),
        pytest.param(HEADER + ROW1.replace("153.7", "hot") + ROW2, id="non-numeric-power"),
        pytest.param(HEADER + ROW1 + ROW2.replace("39 ", "139"), id="aicore-over-100"),
        pytest.param(HEADER + ROW1 + ROW2 + ROW1 + ROW2, id="duplicate-chip"),
        pytest.param(HEADER + ROW1 + ROW2.replace("62810/ 65536", "62810 65536 "), id="missing-slash"),
        pytest.param("| a | b |\n| c |\n", id="random-pipes"),
    ],
)
def test_bad_input_raises_parse_error(text: str) -> None:
    with pytest.raises(ParseError):
        parse_info(text)


def test_parse_error_is_a_value_error_with_a_line_number() -> None:
    with pytest.raises(ValueError, match="line 7"):
        parse_info(HEADER + ROW1.replace("153.7", "hot") + ROW2)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_prefix_parses_or_raises_parse_error(name: str) -> None:
    text = _read(name)
    for end in range(0, len(text), 37):
        try:
            parse_info(text[:end])
        except ParseError:
            pass


# ------------------------------------------------------------------ render


def test_render_matches_the_real_910b3_table_byte_for_byte() -> None:
    text = _read("npu-smi-info_910B3_driver24.1.0_loaded.txt")
    lines = text.splitlines()
    chips = parse_info(text)
    buses = ["0000:C1:00.0", "0000:C2:00.0", "0000:81:00.0", "0000:82:00.0",
             "0000:01:00.0", "0000:02:00.0", "0000:41:00.0", "0000:42:00.0"]
    rendered = render_info(chips, version="24.1.0", bus_ids=buses, process_table=False)
    assert rendered.splitlines() == lines[:30]


def test_render_idle_process_section_matches_real_layout() -> None:
    real = _read("npu-smi-info_910B2_driver23.0.7.txt").splitlines()
    chips = parse_info("\n".join(real))
    buses = ["0000:C1:00.0", "0000:01:00.0", "0000:C2:00.0", "0000:02:00.0",
             "0000:81:00.0", "0000:41:00.0", "0000:82:00.0", "0000:42:00.0"]
    rendered = render_info(chips, version="23.0.7", bus_ids=buses).splitlines()
    assert rendered == real


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_render_round_trips_every_fixture(name: str) -> None:
    chips = parse_info(_read(name))
    assert parse_info(render_info(chips)) == chips


def test_render_rejects_names_that_break_the_layout() -> None:
    for bad in ("two words", "910", "x" * 21):
        with pytest.raises(ValueError):
            render_info([NpuChip(npu_id=0, chip_id=0, name=bad, health="OK")])


_count = st.one_of(st.none(), st.integers(min_value=0, max_value=2_000_000))


@st.composite
def _chips(draw: st.DrawFn) -> list[NpuChip]:
    keys = draw(
        st.lists(
            st.tuples(st.integers(0, 63), st.integers(0, 3)), min_size=1, max_size=12, unique=True
        )
    )
    chips = []
    for npu_id, chip_id in keys:
        chips.append(
            NpuChip(
                npu_id=npu_id,
                chip_id=chip_id,
                aicore_util=draw(st.one_of(st.none(), st.integers(0, 100).map(lambda p: p / 100))),
                hbm_used_mb=draw(_count),
                hbm_total_mb=draw(_count),
                health=draw(st.sampled_from(["OK", "Warning", "Alarm", "Critical", "UNKNOWN"])),
                name=draw(st.from_regex(r"[A-Za-z][A-Za-z0-9_-]{0,18}", fullmatch=True)),
                power_w=draw(st.one_of(st.none(), st.integers(0, 99_999).map(lambda w: w / 10))),
                temp_c=draw(st.one_of(st.none(), st.integers(-40, 150).map(float))),
                memory_used_mb=draw(_count),
                memory_total_mb=draw(_count),
            )
        )
    return chips


@settings(max_examples=200, deadline=None)
@given(_chips())
def test_render_then_parse_round_trips(chips: list[NpuChip]) -> None:
    assert parse_info(render_info(chips)) == chips
