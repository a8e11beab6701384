"""`laswrr npu-smi parse` and `laswrr metrics parse` through laswrr.cli.main."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

import laswrr.cli
from laswrr.cli import main

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real"
CHIP_KEYS = {
    "npu_id", "chip_id", "name", "health", "power_w", "temp_c", "aicore_util",
    "hbm_used_mb", "hbm_total_mb", "memory_used_mb", "memory_total_mb",
}


def test_collectors_cli_is_registered_in_laswrr_cli() -> None:
    assert "laswrr.collectors.cli" in laswrr.cli.COMMAND_MODULES


def test_npu_smi_parse_310p(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["npu-smi", "parse", str(REAL / "npu-smi-info_310P3-300IDuo_driver25.0.rc1.txt")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["chips"] and len(out["chips"]) == 8
    assert all(set(chip) == CHIP_KEYS for chip in out["chips"])
    assert out["chips"][4] == {
        "npu_id": 4, "chip_id": 0, "name": "310P3", "health": "Critical", "power_w": None, "temp_c": 56.0,
        "aicore_util": 0.0, "hbm_used_mb": None, "hbm_total_mb": None,
        "memory_used_mb": 1793, "memory_total_mb": 44280,
    }


def test_npu_smi_parse_stdin(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    text = (REAL / "npu-smi-info_910B3_driver24.1.0_loaded.txt").read_text(encoding="utf-8")
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    assert main(["npu-smi", "parse", "-"]) == 0
    chips = json.loads(capsys.readouterr().out)["chips"]
    assert (chips[0]["aicore_util"], chips[0]["hbm_used_mb"], chips[0]["power_w"]) == (0.39, 62810, 153.7)


@pytest.mark.parametrize("content", [b"", b"garbage\n", b"\x00\xff\xfe\x80 binary", b"| NPU Name | x |\n"])
def test_npu_smi_parse_bad_input_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    assert main(["npu-smi", "parse", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("laswrr npu-smi parse: ") and captured.err.count("\n") == 1


def test_npu_smi_parse_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["npu-smi", "parse", str(tmp_path / "nope.txt")]) == 2
    err = capsys.readouterr().err
    assert "cannot read" in err and err.count("\n") == 1


def test_metrics_parse_mindie(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["metrics", "parse", str(REAL / "mindie-metrics_coordinator-doc_llama3-8b.txt")]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "engine": "mindie", "running": 0, "waiting": 0, "kv_cache_usage": 1.0, "kv_cache_usage_max": 1.0,
        "ttft_seconds": {"sum": None, "count": 2523.0},
        "e2e_seconds": {"sum": 12684.5319980979, "count": 2267.0},
        "models": ["llama3-8b"], "truncated": False,
    }


def test_metrics_parse_sglang_with_engine_flag(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(REAL / "sglang-metrics_v0.4-docs_llama3.1-8b.txt")
    assert main(["metrics", "parse", path, "--engine", "sglang"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["engine"], out["running"], out["waiting"], out["kv_cache_usage"]) == ("sglang", 162, 2826, 0.28)
    assert out["ttft_seconds"]["count"] == 11008.0 and out["e2e_seconds"]["count"] == 11228.0


def test_metrics_parse_nulls_for_absent_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["metrics", "parse", str(REAL / "vllm-metrics_v1_2026_cache-lines_Qwen3.6-27B_trimmed.txt")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["running"], out["waiting"], out["ttft_seconds"], out["e2e_seconds"]) == (None, None, None, None)
    assert out["kv_cache_usage"] == 0.0


def test_metrics_parse_wrong_engine_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(REAL / "mindie-metrics_coordinator-doc_llama3-8b.txt")
    assert main(["metrics", "parse", path, "--engine", "vllm"]) == 2
    assert "no engine metrics" in capsys.readouterr().err


@pytest.mark.parametrize("content", [b"", b"# HELP a b\n# TYPE a gauge\n", b"not metrics at all\n", bytes(range(256))])
def test_metrics_parse_bad_input_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    path = tmp_path / "metrics.txt"
    path.write_bytes(content)
    assert main(["metrics", "parse", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("laswrr metrics parse: ")
    assert captured.err.count("\n") == 1


def test_metrics_parse_missing_file_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["metrics", "parse", "/nonexistent/metrics.txt"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_subcommand_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(["npu-smi"])
    assert excinfo.value.code == 2
