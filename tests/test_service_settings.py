"""Every service command shares one logging flag and reads its defaults from its config dataclass."""

from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest

from laswrr.cli import build_parser
from laswrr.services import settings
from laswrr.services.proxy.cli import config_from_args
from laswrr.services.natsbus import NatsAuth
from laswrr.services.proxy.config import ProxyConfig
from laswrr.services.recorder import RecorderOptions
from laswrr.services.scheduler_service import SchedulerOptions

# sub-command -> the arguments it needs besides the logging flag
SERVICES = {
    "scheduler": [], "recorder": [], "collector": ["--nodes", "n.toml"], "proxy": [], "up": [],
    "sim-engine": ["--port", "0"], "bench": [], "demo": [],
}


@pytest.mark.parametrize("command", sorted(SERVICES))
@pytest.mark.parametrize(("given", "level"), [("warning", "WARNING"), ("INFO", "INFO"), ("DeBuG", "DEBUG"),
                                              ("warn", "WARNING"), ("error", "ERROR")])
def test_every_service_takes_log_level_in_any_case(command: str, given: str, level: str) -> None:
    args = build_parser().parse_args([command, *SERVICES[command], "--log-level", given])
    assert args.log_level == level


@pytest.mark.parametrize("command", sorted(SERVICES))
def test_dash_v_is_debug_and_a_bad_level_is_a_usage_error(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args([command, *SERVICES[command], "-v"]).log_level == "DEBUG"
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([command, *SERVICES[command], "--log-level", "loud"])
    assert exited.value.code == 2
    assert "unknown log level 'loud'" in capsys.readouterr().err


def test_configure_logging_sets_the_level_and_quiets_nats() -> None:
    root = logging.getLogger()
    saved = root.level
    try:
        settings.configure_logging(argparse.Namespace(log_level="WARNING"), "test")
        assert root.level == logging.WARNING
        assert logging.getLogger("nats").level == logging.WARNING
    finally:
        root.setLevel(saved)


def test_proxy_flags_default_to_the_config_dataclass() -> None:
    args = build_parser().parse_args(["proxy", "--proxy-id", "p1", "--nats-url", ProxyConfig().nats_url])
    assert config_from_args(args) == dataclasses.replace(ProxyConfig(), proxy_id="p1", nats_auth=NatsAuth())


def test_scheduler_and_recorder_flags_default_to_their_options() -> None:
    scheduler = build_parser().parse_args(["scheduler"])
    assert (scheduler.tick_ms, scheduler.batch, scheduler.checkpoint_every) == (
        SchedulerOptions.tick_ms, SchedulerOptions.batch, SchedulerOptions.checkpoint_every)
    recorder = build_parser().parse_args(["recorder"])
    assert (recorder.data_dir, recorder.batch, recorder.flush_ms, recorder.durable) == (
        str(RecorderOptions.data_dir), RecorderOptions.batch, RecorderOptions.flush_ms, RecorderOptions.durable)
