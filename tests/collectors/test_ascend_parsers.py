"""The Ascend-source parsers against fixtures written from their sources' definitions
(tests/fixtures/ascend/SOURCES.md): npu-exporter text, MindIE /v1/status, /v2/status and
/metrics-json, and the MindCluster fault-code table. Partial, malformed, cut and stale input
either parses or raises ParseError, and a chip the parser cannot vouch for is left out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from laswrr.collectors.errors import ParseError
from laswrr.collectors.faultcodes import LEVELS, code_hex, fault_table
from laswrr.collectors.mindie import MindieStatus, parse_metrics_json, parse_status
from laswrr.collectors.npu_exporter import (
    ExporterScrape, chip_health, parse_exporter, select_exporter_chips, to_npu_chip)

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "ascend"
TABLE = fault_table((ROOT / "collectors" / "faultcodes.toml").read_text(encoding="utf-8"))
NOW = 1764680003.0  # 3 s after the fixtures' cache time
B3 = "npu-exporter_910B3-8chip_pods_fault.txt"
A3 = "npu-exporter_A3-2npu-4die_separated.txt"
LEGACY = "npu-exporter_mind-cluster-testdata_910A_legacy-vdie_id.txt"
EXPORTER_FIXTURES = (B3, A3, LEGACY)


def _read(name: str) -> str:
    return (FIX / name).read_text(encoding="utf-8")


def test_every_fixture_is_documented() -> None:
    sources = _read("SOURCES.md")
    for path in FIX.iterdir():
        if path.name != "SOURCES.md":
            assert f"`{path.name}`" in sources, path.name


# -- npu-exporter ------------------------------------------------------------------------------


def test_910b3_host_chips_pods_and_units() -> None:
    scrape = parse_exporter(_read(B3), now_s=NOW, max_age_s=15)
    assert [c.id for c in scrape.chips] == list(range(8)) and scrape.missing == () and scrape.npu_count == 8
    chip0 = scrape.chips[0]
    assert (chip0.namespace, chip0.pod_name, chip0.container_name) == ("default", "mindie-a-0", "mindie")
    assert chip0.aicore_util == 0.38 and chip0.overall_util == 0.41 and chip0.util == 0.41  # NPU % preferred
    assert (chip0.hbm_used_mb, chip0.hbm_total_mb, chip0.power_w, chip0.temp_c) == (57344, 65536, 162.3, 61.0)
    assert chip0.pcie_bus_info == "0000:C1:00.0" and chip0.model_name == "910B3"
    assert scrape.chips[6].error_codes == (0x80E18402, 0x80E3A202) and scrape.chips[6].health_status == 0


def test_fault_codes_set_health_with_the_cause() -> None:
    chips = parse_exporter(_read(B3)).chips
    assert chip_health(chips[0], TABLE) == ("OK", None)
    word, cause = chip_health(chips[6], TABLE)
    assert word == "Critical" and cause == "fault 80E18402 SeparateNPU; fault 80E3A202 RestartNPU"
    npu = to_npu_chip(chips[6], TABLE)
    assert (npu.npu_id, npu.chip_id, npu.health, npu.fault) == (6, 0, "Critical", cause)


def test_health_gauge_zero_alone_drains_and_network_zero_warns() -> None:
    text = _read(B3).replace(" 2162263042 ", " 0 ").replace(" 2162401794 ", " 0 ")
    chip6 = parse_exporter(text).chips[6]
    assert chip_health(chip6, TABLE) == ("Alarm", "npu_chip_info_health_status 0 (unhealthy)")
    net = "\n".join(ln.replace("} 1 ", "} 0 ") if ln.startswith("npu_chip_info_network_status") and 'id="5"' in ln
                    else ln for ln in text.splitlines()) + "\n"
    assert chip_health(parse_exporter(net).chips[5], TABLE)[0] == "Warning"


def test_two_chip_npus_map_ids_to_npu_and_chip() -> None:
    scrape = parse_exporter(_read(A3))
    chips = [to_npu_chip(c, TABLE, chips_per_npu=2) for c in scrape.chips]
    assert [(c.npu_id, c.chip_id) for c in chips] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [c.health for c in chips] == ["OK", "OK", "OK", "Critical"] and chips[3].fault == "fault 80E3A201 SeparateNPU"
    mine = select_exporter_chips(scrape.chips, npu_ids=[1], pairs=[], pod={}, chips_per_npu=2)
    assert [c.id for c in mine] == [2, 3]
    assert [c.id for c in select_exporter_chips(scrape.chips, [], [(0, 1)], {}, 2)] == [1]


def test_chips_chosen_by_pod_labels() -> None:
    chips = parse_exporter(_read(B3)).chips
    assert [c.id for c in select_exporter_chips(chips, [], [], {"pod_name": "mindie-b-0"})] == [2, 3]
    assert [c.id for c in select_exporter_chips(chips, [], [], {"namespace": "default", "pod_name": "mindie-a-0"})] == [0, 1]
    assert select_exporter_chips(chips, [], [], {"namespace": "other", "pod_name": "mindie-a-0"}) == []
    assert len(select_exporter_chips(chips, [], [], {})) == 8


def test_legacy_label_set_and_stale_cache() -> None:
    fresh = parse_exporter(_read(LEGACY))
    assert len(fresh.chips) == 8 and all(c.health_status == 1 and c.util is None for c in fresh.chips)
    stale = parse_exporter(_read(LEGACY), now_s=NOW, max_age_s=15)
    assert stale.chips == () and len(stale.missing) == 8 and "stale" in stale.missing[0]


def test_stale_chip_is_missing_not_guessed() -> None:
    text = _read(B3).replace('id="7",model_name="910B3",namespace="",pcie_bus_info="0000:42:00.0",pod_name="",v_dev_id=""} 1 1764680000000',
                             'id="7",model_name="910B3",namespace="",pcie_bus_info="0000:42:00.0",pod_name="",v_dev_id=""} 1 1764679900000')
    scrape = parse_exporter(text, now_s=NOW, max_age_s=15)
    assert [c.id for c in scrape.chips] == list(range(7)) and scrape.missing[0].startswith("id 7: stale")


def test_partial_chip_without_health_is_missing() -> None:
    lines = [ln for ln in _read(B3).splitlines() if not (ln.startswith("npu_chip_info_health_status") and 'id="3"' in ln)]
    scrape = parse_exporter("\n".join(lines) + "\n")
    assert 3 not in [c.id for c in scrape.chips] and "id 3: no npu_chip_info_health_status" in scrape.missing[0]


def test_out_of_range_readings_are_none_not_values() -> None:
    text = ('npu_chip_info_health_status{id="0"} 1\nnpu_chip_info_utilization{id="0"} -1\n'
            'npu_chip_info_hbm_used_memory{id="0"} -1\nnpu_chip_info_temperature{id="0"} 4294967295\n')
    chip = parse_exporter(text).chips[0]
    assert (chip.aicore_util, chip.hbm_used_mb, chip.temp_c) == (None, None, None)
    assert chip_health(parse_exporter('npu_chip_info_health_status{id="0"} -1\n').chips[0], TABLE)[0] == "UNKNOWN"


@pytest.mark.parametrize("name", EXPORTER_FIXTURES)
def test_every_prefix_parses_or_raises_parse_error(name: str) -> None:
    text = _read(name)
    for end in range(0, len(text), max(1, len(text) // 120)):
        try:
            scrape = parse_exporter(text[:end], now_s=NOW, max_age_s=15)
        except ParseError:
            continue
        assert isinstance(scrape, ExporterScrape)


@pytest.mark.parametrize(("text", "match"), [
    ("", "empty"), ("<html><body>502</body></html>\n", "not a Prometheus"),
    ("vllm:num_requests_running 3\n", "no npu-exporter metrics"),
    ('npu_chip_info_health_status{id="x"} 1\n', "not a device number"),
    ('npu_chip_info_health_status{id="0"} NaN\n', "finite"),
])
def test_bad_exporter_input(text: str, match: str) -> None:
    with pytest.raises(ParseError, match=match):
        parse_exporter(text)


# -- fault codes ---------------------------------------------------------------------------------


def test_fault_table_levels_and_health() -> None:
    assert TABLE.level(0x80E18402) == "SeparateNPU" and TABLE.health("SeparateNPU") == "Critical"
    assert TABLE.level(0x80C98008) == "RestartRequest" and TABLE.health("RestartRequest") == "Warning"
    assert TABLE.level(0x8C204E00) == "RestartBusiness" and TABLE.health("RestartBusiness") == "Alarm"
    assert TABLE.level(0x80E21007) == "NotHandleFault" and TABLE.health("NotHandleFault") == "OK"
    assert TABLE.level(0xA2301001) == "SeparateNPU"  # listed twice in faultCode.json: the severer level
    assert TABLE.level(0x12345678) == "unknown" and TABLE.health("unknown") == "Warning"
    assert code_hex(2162263042) == "80E18402"
    assert {TABLE.health(level) for level in LEVELS} <= {"OK", "Warning", "Alarm", "Critical"}


@pytest.mark.parametrize(("text", "match"), [
    ("[health", "not valid TOML"), ("x = 1", "needs a"),
    ('[health]\nNotHandleFault = "Fine"\n[codes]\n', "must be one of"),
    ("\n".join(["[health]"] + [f'{lv} = "OK"' for lv in (*LEVELS, "unknown")] + ['[codes]', 'Bogus = ["1"]']), "unknown level"),
    ("\n".join(["[health]"] + [f'{lv} = "OK"' for lv in (*LEVELS, "unknown")] + ['[codes]', 'SeparateNPU = ["zz"]']), "not a hex"),
])
def test_bad_fault_table(text: str, match: str) -> None:
    with pytest.raises(ParseError, match=match):
        fault_table(text)


# -- MindIE ----------------------------------------------------------------------------------------


def test_status_single_node() -> None:
    status = parse_status(_read("mindie-status-v1_single-node.json"))
    assert status == MindieStatus(ready=True, role_status="RoleReady", current_role="none", avail_slots=150,
                                  avail_blocks=2310, multi_node=False, waiting=0, running=50, swapped=0,
                                  free_npu_blocks=2310, total_npu_blocks=4096)


def test_status_multi_node_has_no_running_or_waiting() -> None:
    status = parse_status(_read("mindie-status-v2_multi-node.json"))
    assert (status.multi_node, status.avail_slots, status.avail_blocks, status.max_avail_blocks) == (True, 200, 300, 100)
    assert status.running is None and status.waiting is None and status.current_role == "decode"


def test_status_switching_is_not_ready() -> None:
    status = parse_status(_read("mindie-status-v1_switching_flex.json"))
    assert not status.ready and status.current_role == "flex" and status.total_npu_blocks is None


def test_v2_with_both_forms_prefers_single_node_counts() -> None:
    doc = json.loads(_read("mindie-status-v1_single-node.json"))
    doc["resource"].update({"totalAvailNpuSlotsNum": 7, "totalAvailNpuBlockNum": 8, "maxAvailNpuBlockNum": 8})
    status = parse_status(json.dumps(doc))
    assert (status.avail_slots, status.avail_blocks, status.multi_node) == (150, 2310, False)


@pytest.mark.parametrize(("text", "match"), [
    ("", "empty"), ("{", "not JSON"), ("[1]", "not a JSON object"), ('{"service": {}}', "needs 'service'"),
    ('{"service": {"roleStatus": 1}, "resource": {}}', "must be strings"),
    ('{"service": {"roleStatus": "RoleReady"}, "resource": {}}', "neither availSlotsNum"),
    ('{"service": {"roleStatus": "RoleReady"}, "resource": {"availSlotsNum": 3}}', "availBlockNum is missing"),
    ('{"service": {"roleStatus": "RoleReady"}, "resource": {"availSlotsNum": -1, "availBlockNum": 1}}', "out of range"),
    ('{"service": {"roleStatus": "RoleReady"}, "resource": {"availSlotsNum": 1.5, "availBlockNum": 1}}', "whole"),
    ('{"service": {"roleStatus": "RoleReady"}, "resource": {"availSlotsNum": true, "availBlockNum": 1}}', "not a number"),
    ('{"service": {"roleStatus": "RoleReady"}, "resource": {"availSlotsNum": 1, "availBlockNum": 1, '
     '"freeNpuBlockNums": 9, "totalNpuBlockNums": 4}}', "> totalNpuBlockNums"),
    ("[" * 100000, "not JSON"),
])
def test_bad_status(text: str, match: str) -> None:
    with pytest.raises(ParseError, match=match):
        parse_status(text)


def test_metrics_json() -> None:
    metrics = parse_metrics_json(_read("mindie-metrics-json.json"))
    assert (metrics.ttft_ms, metrics.tbt_ms, metrics.waiting, metrics.processing, metrics.remain_blocks) == \
        (412.0, 38.0, 3, 53, 2310)
    idle = parse_metrics_json(_read("mindie-metrics-json.json").replace('"412"', '"0"'))
    assert idle.ttft_ms is None  # 0 = no request finished yet


@pytest.mark.parametrize(("text", "match"), [
    ("", "empty"), ('{"result": 3}', "must be a list"), ('{"result": [1]}', "not an object"),
    ('{"result": []}', "none of"), ('{"result": [{"metric": [{"__name__": "TTFT"}], "value": "x"}]}', "not a number"),
    ('{"result": [{"metric": [{"__name__": "TTFT"}], "value": "-3"}]}', "not a number"),
])
def test_bad_metrics_json(text: str, match: str) -> None:
    with pytest.raises(ParseError, match=match):
        parse_metrics_json(text)


@pytest.mark.parametrize("name", ["mindie-status-v1_single-node.json", "mindie-status-v2_multi-node.json",
                                  "mindie-metrics-json.json"])
def test_every_json_prefix_parses_or_raises_parse_error(name: str) -> None:
    text = _read(name)
    parse = parse_metrics_json if "metrics" in name else parse_status
    for end in range(len(text)):
        try:
            parse(text[:end])
        except ParseError:
            pass
