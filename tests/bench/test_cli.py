"""`laswrr bench` / `laswrr demo` argument handling: clear one-line errors, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from laswrr.cli import main


@pytest.mark.parametrize("argv, message", [
    (["bench", "--policies", "la-swrr,bogus"], "unknown policy bogus"),
    (["bench", "--scenario", "nope"], "unknown scenario 'nope'"),
    (["bench", "--duration-scale", "0"], "--duration-scale must be > 0"),
    (["bench", "--util", "-1"], "--util must be within"),
    (["bench", "--scheduler-config", "/nonexistent/x.toml"], "cannot read"),
    (["demo", "--duration-scale", "-2"], "--duration-scale must be > 0"),
])
def test_bad_arguments_exit_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_bad_scheduler_config_key_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.toml"
    path.write_text("[scheduler]\nw_bogus = 1\n")
    assert main(["bench", "--scheduler-config", str(path)]) == 2
    assert "unknown configuration key(s): w_bogus" in capsys.readouterr().err


def test_list_names_every_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("announced-drop", "silent-slowdown", "heterogeneous", "crash-return", "bursty"):
        assert name in out


def test_policies_default_and_peer_names() -> None:
    from laswrr.bench.cli import DEFAULT_POLICIES, parse_policies
    from laswrr.bench.stack_adapter import vllm_router_binary

    assert parse_policies(None, peers=False) == list(DEFAULT_POLICIES)
    with_peer = parse_policies(None)
    assert with_peer[:4] == list(DEFAULT_POLICIES)
    assert with_peer[4:] == (["vllm-router:power_of_two"] if vllm_router_binary() else [])
    assert parse_policies("rr, la-swrr") == ["rr", "la-swrr"]
    with pytest.raises(ValueError, match="unknown policy vllm-router:bogus"):
        parse_policies("vllm-router:bogus")
    with pytest.raises(ValueError, match="unknown policy nginx:cache_aware"):
        parse_policies("nginx:cache_aware")


def test_overload_runs_every_row_in_one_run_by_default() -> None:
    from laswrr.bench.cli import DEFAULT_POLICIES, parse_policies, scenario_policies
    from laswrr.bench.scenarios import get_scenario

    overload, drop = get_scenario("overload"), get_scenario("announced-drop")
    default = parse_policies(None, peers=False)
    assert scenario_policies(overload, default, named=False) == [
        "la-swrr+flow", "la-swrr", "la-swrr+cap", *DEFAULT_POLICIES[1:]]
    assert scenario_policies(overload, [*default, "vllm-router:power_of_two"], named=False)[-1] == \
        "vllm-router:power_of_two"
    assert scenario_policies(overload, ["rr", "la-swrr"], named=True) == ["rr", "la-swrr"]  # --policies as given
    assert scenario_policies(drop, default, named=False) == default


def test_peer_names_map_to_their_routers() -> None:
    from laswrr.bench.stack_adapter import is_peer, peer_of, request_model

    assert peer_of("sglang-router:cache_aware") == ("sglang-router", "cache_aware")
    assert peer_of("vllm-router:power_of_two") == ("vllm-router", "power_of_two")
    assert peer_of("la-swrr") is None and not is_peer("p2c") and is_peer("sglang-router:random")
    assert request_model("sglang-router:cache_aware") == "sim-llm"  # it would route to model "unknown"
    assert request_model("vllm-router:cache_aware") is None and request_model("la-swrr") is None
