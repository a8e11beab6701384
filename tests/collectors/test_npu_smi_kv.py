"""parse_kv / kv_chip_metrics against the real `npu-smi info -t ...` views (values read by eye)."""

from __future__ import annotations

from pathlib import Path

import pytest

from laswrr.collectors.errors import ParseError
from laswrr.collectors.npu_smi import KvChipMetrics, kv_chip_metrics, parse_kv

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real"


def _read(name: str) -> str:
    return (REAL / name).read_text(encoding="utf-8")


# file -> (block count, expected metrics of chip 0)
EXPECTED: dict[str, tuple[int, KvChipMetrics]] = {
    "npu-smi-info-t-usages_910B1_driver23.0.rc2.txt": (
        2,
        KvChipMetrics(npu_id=0, chip_id=0, util=0.0, npu_util=None, aicore_util=0.0, hbm_usage=0.04,
                      hbm_total_mb=65536, memory_usage=0.0, power_w=None, temp_c=None),
    ),
    "npu-smi-info-t-usages_910B_driver25.5.1.txt": (
        2,
        KvChipMetrics(npu_id=0, chip_id=0, util=0.0, npu_util=0.0, aicore_util=0.0, hbm_usage=0.05,
                      hbm_total_mb=65536, memory_usage=0.0, power_w=None, temp_c=None),
    ),
    "npu-smi-info-t-common_910B1_driver23.0.rc2.txt": (
        3,
        KvChipMetrics(npu_id=1, chip_id=0, util=0.0, npu_util=None, aicore_util=0.0, hbm_usage=0.04,
                      hbm_total_mb=None, memory_usage=0.0, power_w=93.4, temp_c=46.0),
    ),
    "npu-smi-info-t-temp_910B_driver25.5.1.txt": (
        3,
        KvChipMetrics(npu_id=0, chip_id=0, util=None, npu_util=None, aicore_util=None, hbm_usage=None,
                      hbm_total_mb=None, memory_usage=None, power_w=None, temp_c=39.0),
    ),
    "npu-smi-info-t-power_910B_driver25.5.1.txt": (
        2,
        KvChipMetrics(npu_id=0, chip_id=0, util=None, npu_util=None, aicore_util=None, hbm_usage=None,
                      hbm_total_mb=None, memory_usage=None, power_w=103.5, temp_c=None),
    ),
    "npu-smi-info-t-board_910B_driver25.5.1.txt": (
        1,
        KvChipMetrics(npu_id=0, chip_id=None, util=None, npu_util=None, aicore_util=None, hbm_usage=None,
                      hbm_total_mb=None, memory_usage=None, power_w=None, temp_c=None),
    ),
}


def test_every_kv_fixture_is_covered() -> None:
    assert {p.name for p in REAL.glob("npu-smi-info-t-*.txt")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_blocks_and_chip_metrics(name: str) -> None:
    count, expected = EXPECTED[name]
    blocks = parse_kv(_read(name))
    assert len(blocks) == count
    assert kv_chip_metrics(blocks, 0) == expected


def test_usages_chip_id_is_a_trailer() -> None:
    blocks = parse_kv(_read("npu-smi-info-t-usages_910B1_driver23.0.rc2.txt"))
    assert blocks[0] == {"NPU ID": "0", "Chip Count": "1"}
    assert list(blocks[1])[-1] == "Chip ID"
    assert blocks[1]["HBM Capacity(MB)"] == "65536"


def test_common_chip_id_is_a_header_and_mcu_block_is_ignored() -> None:
    blocks = parse_kv(_read("npu-smi-info-t-common_910B1_driver23.0.rc2.txt"))
    assert list(blocks[1])[0] == "Chip ID"
    assert blocks[1]["Aicore curFreq(MHZ)"] == "800"
    assert blocks[2] == {"Chip Name": "mcu", "Temperature(C)": "38"}
    assert kv_chip_metrics(blocks).temp_c == 46.0  # the chip's, not the MCU's 38


def test_temp_view_key_with_space_and_mcu_sensors() -> None:
    blocks = parse_kv(_read("npu-smi-info-t-temp_910B_driver25.5.1.txt"))
    assert blocks[1]["NPU Temperature (C)"] == "39"
    assert blocks[2]["LM75A_TE (C)"] == "36"
    assert blocks[2]["Chip Name"] == "MCU"


def test_board_view_values_with_colons_na_and_hex() -> None:
    (block,) = parse_kv(_read("npu-smi-info-t-board_910B_driver25.5.1.txt"))
    assert block["PCIe Bus Info"] == "0000:C1:00.0"  # split on the FIRST ':'
    assert block["Model"] == "NA"
    assert block["PCI Device ID"] == "0xD802"
    assert block["Firmware Version"] == "7.8.0.6.201"


def test_tab_indent_like_real_output() -> None:
    text = _read("npu-smi-info-t-usages_910B_driver25.5.1.txt").replace("        ", "\t")
    assert kv_chip_metrics(parse_kv(text)).hbm_usage == pytest.approx(0.05)


def test_npu_utilization_preferred_over_aicore() -> None:
    text = "\tNPU ID : 3\n\tChip Count : 1\n\n\tAicore Usage Rate(%) : 20\n\tNPU Utilization(%) : 65\n\tChip ID : 0\n"
    metrics = kv_chip_metrics(parse_kv(text))
    assert (metrics.npu_id, metrics.util, metrics.aicore_util, metrics.npu_util) == (3, 0.65, 0.2, 0.65)


def test_power_dissipation_variant_and_na_value() -> None:
    text = "NPU ID : 0\nChip Count : 1\n\nPower Dissipation(W) : 8.5\nTemperature(C) : NA\nChip ID : 0\n"
    metrics = kv_chip_metrics(parse_kv(text))
    assert (metrics.power_w, metrics.temp_c) == (8.5, None)


def test_two_chip_view_selects_by_chip_id() -> None:
    text = (
        "NPU ID : 4\nChip Count : 2\n\n"
        "Aicore Usage Rate(%) : 10\nChip ID : 0\n\n"
        "Aicore Usage Rate(%) : 70\nChip ID : 1\n"
    )
    blocks = parse_kv(text)
    assert kv_chip_metrics(blocks, 1).aicore_util == pytest.approx(0.7)
    assert kv_chip_metrics(blocks, 0).aicore_util == pytest.approx(0.1)
    with pytest.raises(ParseError, match="Chip ID 2"):
        kv_chip_metrics(blocks, 2)


def test_paste_without_blank_lines_splits_on_repeated_key() -> None:
    text = "\n".join(line for line in _read("npu-smi-info-t-common_910B1_driver23.0.rc2.txt").splitlines() if line.strip())
    blocks = parse_kv(text)
    assert len(blocks) == 2 and blocks[-1] == {"Temperature(C)": "38"}  # the MCU's, split off
    metrics = kv_chip_metrics(blocks)
    assert (metrics.npu_id, metrics.temp_c, metrics.power_w) == (1, 46.0, 93.4)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param("\n\n  \n", id="blank"),
        pytest.param("hello world\n", id="garbage-no-colon"),
        pytest.param("foo : bar\nbaz : 1\n", id="kv-but-not-npu-smi"),
        pytest.param("\x00\xff\x8f\x01noise\n", id="binary-noise"),
        pytest.param(" : value\nNPU ID : 0\n", id="empty-key"),
    ],
)
def test_bad_kv_input_raises_parse_error(text: str) -> None:
    with pytest.raises(ParseError):
        parse_kv(text)


def test_non_numeric_value_raises_parse_error() -> None:
    blocks = parse_kv("NPU ID : 0\n\nHBM Usage Rate(%) : lots\nChip ID : 0\n")
    with pytest.raises(ParseError, match="lots"):
        kv_chip_metrics(blocks)


def test_percent_over_100_raises_parse_error() -> None:
    blocks = parse_kv("NPU ID : 0\n\nAicore Usage Rate(%) : 250\nChip ID : 0\n")
    with pytest.raises(ParseError):
        kv_chip_metrics(blocks)
