"""Flags and names shared by every command: LASWRR_* variables, durations with units, policy
aliases, --version, `laswrr up --proxy-host` and the proxy settings `up` reaches; and
docs/configuration.md's generated tables are current."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from laswrr import __version__
from laswrr.bench.cli import parse_policies
from laswrr.cli import build_parser, env_name, with_environment
from laswrr.scheduler.policies import canonical_policy
from laswrr.services import settings

ROOT = Path(__file__).resolve().parents[1]


def parse(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    return parser.parse_args(with_environment(parser, argv, environ or {}))


def test_every_flag_is_also_a_laswrr_variable_and_the_command_line_wins() -> None:
    env = {"LASWRR_LOG_LEVEL": "warning", "LASWRR_GRACE_S": "500ms", "LASWRR_REUSE_PORT": "yes",
           "LASWRR_POLICY": "round_robin", "LASWRR_TICK_MS": "1s"}
    proxy = parse(["proxy"], env)
    assert (proxy.log_level, proxy.grace_s, proxy.reuse_port, proxy.policy) == ("WARNING", 0.5, True, "rr")
    assert parse(["proxy", "--log-level", "error", "--grace-s=2"], env).log_level == "ERROR"
    assert parse(["proxy", "--grace-s=2"], env).grace_s == 2.0
    assert parse(["scheduler"], env).tick_ms == 1000
    assert parse(["capacity", "n1", "3"], {"LASWRR_WAIT": "2s"}).wait == 2.0  # positionals stay in place
    assert parse(["proxy"], {"LASWRR_REUSE_PORT": "off"}).reuse_port is False
    assert parse(["up"], {"LASWRR_FLOW_CONTROL": "0"}).flow_control is False  # off where up's default is on
    assert parse(["up"], {"LASWRR_FLOW_CONTROL": "yes"}).flow_control is True
    assert parse(["scheduler"], {"LASWRR_NO_CHECKPOINT": "0"}).no_checkpoint is False
    assert env_name("--npu-interval-ms") == "LASWRR_NPU_INTERVAL_MS"


def test_a_bad_variable_is_a_usage_error_that_names_it() -> None:
    run = subprocess.run([sys.executable, "-m", "laswrr", "proxy"], capture_output=True, text=True,
                         env={"LASWRR_LOG_FORMAT": "xml", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 2
    assert "invalid choice: 'xml'" in run.stderr and "LASWRR_LOG_FORMAT" in run.stderr
    with pytest.raises(SystemExit):
        parse(["proxy"], {"LASWRR_REUSE_PORT": "maybe"})


@pytest.mark.parametrize(("unit", "text", "value"), [
    ("s", "2", 2.0), ("s", "500ms", 0.5), ("s", "1.5m", 90.0), ("s", "1h", 3600.0), ("s", " 2S ", 2.0),
    ("ms", "250", 250), ("ms", "0.2s", 200), ("ms", "2m", 120_000),
])
def test_durations_take_units(unit: str, text: str, value: float) -> None:
    assert settings.duration(unit)(text) == value


@pytest.mark.parametrize(("unit", "text"), [("ms", "0.5"), ("ms", "1.0005s"), ("s", "fast"), ("s", "-1s"), ("s", "")])
def test_bad_durations_are_usage_errors(unit: str, text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        settings.duration(unit)(text)


def test_duration_flags_of_the_services_take_units() -> None:
    collector = parse(["collector", "--nodes", "n.toml", "--interval-ms", "1s", "--npu-timeout-ms", "5s",
                       "--stats-interval-s", "1m"])
    assert (collector.interval_ms, collector.npu_timeout_ms, collector.stats_interval_s) == (1000, 5000, 60.0)
    proxy = parse(["proxy", "--upstream-timeout-s", "5m", "--connect-timeout-s", "750ms"])
    assert (proxy.upstream_timeout_s, proxy.connect_timeout_s) == (300.0, 0.75)
    assert parse(["recorder", "--flush-ms", "0.1s"]).flush_ms == 100
    assert parse(["up", "--tick-ms", "50ms"]).tick_ms == 50


def test_policy_aliases_of_the_peer_routers() -> None:
    assert [canonical_policy(n) for n in ("round_robin", "Power_Of_Two", "least_request", "LA-SWRR", "p2c")] == [
        "rr", "p2c", "least-request", "la-swrr", "p2c"]
    assert parse(["proxy", "--policy", "power_of_two"]).policy == "p2c"
    assert parse_policies("round_robin,least_request,la-swrr") == ["rr", "least-request", "la-swrr"]
    with pytest.raises(ValueError, match="unknown policy 'cache_aware'"):
        canonical_policy("cache_aware")
    with pytest.raises(SystemExit):
        parse(["proxy", "--policy", "cache_aware"])


def test_version() -> None:
    run = subprocess.run([sys.executable, "-m", "laswrr", "--version"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == f"laswrr {__version__}"
    assert __version__[0].isdigit() and __version__ != "0+unknown"  # the installed distribution's


def test_the_generated_sections_of_the_docs_are_current() -> None:
    """docs/configuration.md's tables (every command's flags, the proxy's settings, the scheduler
    keys) are written by laswrr/docgen.py from the parsers and declarations; a stale one fails."""
    from laswrr import docgen

    stale = [str(path.relative_to(ROOT)) for path in docgen.stale()]
    assert not stale, f"stale generated sections in {stale}: run `{docgen.COMMAND}`"
    text = (ROOT / "docs" / "configuration.md").read_text()
    for name in ("command-flags", "proxy-settings", "scheduler-keys"):
        assert f"<!-- generated: {name} -->" in text
    # per command, with that command's own default (a shared flag used to show its first command's)
    assert "| `--host` | `LASWRR_HOST` | listen address; 0.0.0.0 for every interface (default 127.0.0.1) |" in text
    assert "| `ease_max_step` | `0.25` | share |" in text  # every scheduler key


def test_docgen_rewrites_marked_sections_and_refuses_unknown_ones(tmp_path: Path) -> None:
    from laswrr import docgen

    text = "a\n<!-- generated: scheduler-keys -->\nSTALE BODY\n<!-- end generated -->\nb\n"
    new = docgen.render(text)
    assert new.startswith("a\n<!-- generated: scheduler-keys -->\n| key |") and new.endswith("<!-- end generated -->\nb\n")
    assert "STALE BODY" not in new and docgen.render(new) == new
    with pytest.raises(ValueError, match="no generated section 'nope'"):
        docgen.render("<!-- generated: nope -->\n<!-- end generated -->\n", "x.md")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text(text)
    (tmp_path / "README.md").write_text("nothing generated\n")
    assert docgen.stale(tmp_path) == [tmp_path / "docs" / "x.md"]


async def test_up_binds_the_proxy_to_proxy_host(tmp_path: Path) -> None:
    (tmp_path / "nodes.toml").write_text('[[node]]\nid = "n1"\nurl = "http://127.0.0.1:9"\ncapacity = 2\n')
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "laswrr", "up", "--nodes", str(tmp_path / "nodes.toml"), "--data-dir",
        str(tmp_path / "data"), "--proxy-port", "0", "--proxy-host", "127.0.0.2",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
    try:
        assert proc.stdout is not None
        proxy_url = ""
        while not proxy_url:
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            assert line, "laswrr up exited early"
            if line.strip().startswith("proxy URL:"):
                proxy_url = line.split()[2]
        assert proxy_url.startswith("http://127.0.0.2:")
        reader, writer = await asyncio.open_connection("127.0.0.2", int(proxy_url.rsplit(":", 1)[1]))
        writer.close()
    finally:
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.wait(), 60)


def test_every_duration_flag_takes_units() -> None:
    """The rule of docs/configuration.md: a flag named ``*-ms`` or ``*-s`` is a duration."""
    from laswrr.cli import commands

    for name, command in commands(build_parser()).items():
        for action in command._actions:
            for flag in action.option_strings:
                if flag.endswith(("-ms", "-s")) and action.nargs != 0:
                    assert getattr(action.type, "__name__", "").startswith("duration_"), f"laswrr {name} {flag}"


def _listening_addresses(port: int) -> set[str]:
    """The local addresses of the sockets listening on ``port`` (Linux /proc/net/tcp, hex)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.add(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


@pytest.mark.parametrize(("given", "bound", "note"), [((), "127.0.0.1", ""),
                                                      (("--host", "0.0.0.0"), "0.0.0.0", "every interface")])
def test_a_standalone_proxy_listens_on_loopback_and_says_where_it_listens(
        given: tuple[str, ...], bound: str, note: str) -> None:
    """Issue 43 item 5: `laswrr proxy` binds 127.0.0.1 unless --host says otherwise, and its first
    line says where it listens (on every interface: the URL is loopback's, and the line says so)."""
    from laswrr.services.nats_server import free_port

    assert parse(["proxy"]).host == "127.0.0.1"
    proc = subprocess.Popen([sys.executable, "-m", "laswrr", "proxy", "--port", "0", "--nats-url",
                             f"nats://127.0.0.1:{free_port()}", *given], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("proxy listening on http://127.0.0.1:"), line
        port = int(line.split()[3].rsplit(":", 1)[1])
        assert _listening_addresses(port) == {bound}
        assert (note in line) if note else line.split() == line.split()[:4]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


# -- the proxy's settings under `laswrr up` -------------------------


def _up_proxy(argv: list[str], table: dict[str, object] | None = None) -> list[str]:
    from laswrr.services.proxy.cli import proxy_argv, up_settings

    args = parse(["up", *argv])
    return proxy_argv(up_settings(args, table or {}, args.proxy_arg), skip=("host", "port", "workers", "proxy_id"))


def test_up_turns_flow_control_on_by_default_and_reaches_every_proxy_setting() -> None:
    assert _up_proxy([]) == ["--flow-control"]
    assert _up_proxy(["--no-flow-control"]) == []
    assert _up_proxy(["--proxy-arg", "queue_bound=64", "--proxy-arg", "key-max-inflight=3", "--api-keys", "k.txt",
                      "--proxy-arg=--retry-after-cap-s=2m", "--proxy-arg", "extra_routes=/v1/x,/v1/y"]) == [
        "--extra-routes=/v1/x,/v1/y", "--api-keys=k.txt", "--key-max-inflight=3", "--flow-control",
        "--queue-bound=64", "--retry-after-cap-s=120.0"]
    # a [proxy] table of the --config file; the command line wins over it
    table = {"flow_control": False, "queue_ttl_ms": "2s", "interactive_reserve": 0.25, "extra_routes": ["/v1/z"]}
    assert _up_proxy([], table) == ["--extra-routes=/v1/z", "--queue-ttl-ms=2000", "--interactive-reserve=0.25"]
    assert "--queue-ttl-ms=500" in _up_proxy(["--proxy-arg", "queue_ttl_ms=500", "--flow-control"], table)
    # the flags the proxy gets parse back to the same settings
    from laswrr.services.proxy.cli import config_from_args, parser, up_settings

    args = parse(["up", "--proxy-arg", "flow_quantum=99", "--event-flush-ms", "7"])
    config = up_settings(args, table, args.proxy_arg)
    again = config_from_args(parser().parse_args([*_up_proxy(["--proxy-arg", "flow_quantum=99", "--event-flush-ms",
                                                              "7"], table), "--proxy-id", "proxy"]))
    assert again == dataclasses.replace(config, proxy_id="proxy", nats_auth=again.nats_auth)


@pytest.mark.parametrize(("argv", "message"), [
    (["--proxy-arg", "queue_bund=64"], "unknown proxy setting 'queue_bund'"),
    (["--proxy-arg", "queue_bound"], "give KEY=VALUE"),
    (["--proxy-arg", "queue_bound=lots"], "queue_bound: invalid literal"),
    (["--proxy-arg", "flow_control=maybe"], "not a switch"),
    (["--proxy-arg", "key_max_inflight=2"], "--key-max-inflight needs --api-keys"),
    (["--proxy-arg", "heartbeat_s=1"], "unknown proxy setting"),
])
def test_up_refuses_a_bad_proxy_setting(argv: list[str], message: str) -> None:
    from laswrr.services.proxy.cli import up_settings

    args = parse(["up", *argv])
    with pytest.raises(ValueError, match=re.escape(message)):
        up_settings(args, {}, args.proxy_arg)


def test_up_refuses_a_bad_proxy_table_before_starting_anything(tmp_path: Path) -> None:
    config = tmp_path / "laswrr.toml"
    config.write_text("[scheduler]\nease_max_step = 0.5\n\n[proxy]\nqueue_bound = 0\n")
    run = subprocess.run([sys.executable, "-m", "laswrr", "up", "--config", str(config), "--data-dir",
                          str(tmp_path / "data")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--queue-bound must be >= 1" in run.stderr
    assert not (tmp_path / "data").exists()
    from laswrr.scheduler.config import load_file

    assert load_file(str(config)).ease_max_step == 0.5  # the scheduler reads its table beside the proxy's
    config.write_text("ease_max_step = 0.5\n\n[proxy]\nqueue_bound = 8\n")
    assert load_file(str(config)).ease_max_step == 0.5


def test_up_banner_says_flow_control_and_whether_keys_are_required() -> None:
    from laswrr.services.up import proxy_lines

    flow, keys = proxy_lines(_up_proxy([]))
    assert flow.startswith("flow control: on") and "429 with Retry-After" in flow and "laswrr_proxy_queue_depth" in flow
    assert keys.startswith("API keys: none")
    flow, keys = proxy_lines(_up_proxy(["--no-flow-control", "--api-keys", "k.txt", "--proxy-arg",
                                        "key_max_inflight=2"]))
    assert flow.startswith("flow control: off")
    assert keys.startswith("API keys: required: clients must send Authorization: Bearer <key> (keys in k.txt")
    assert "at most 2 in flight per key" in keys


def test_up_names_its_proxies_itself() -> None:
    from laswrr.services.proxy.cli import up_settings

    args = parse(["up", "--proxy-arg", "proxy_id=edge"])
    with pytest.raises(ValueError, match="names its proxies itself"):
        up_settings(args, {}, args.proxy_arg)
    with pytest.raises(ValueError, match="names its proxies itself"):
        up_settings(parse(["up"]), {"proxy_id": "edge"}, [])


async def test_a_connection_error_on_the_default_url_says_where_up_wrote_its_url(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 43 item 15: the CLI's default URL never matches `laswrr up`'s port; the error says
    how to use the URL `up` wrote (naming the file when it is in ./.laswrr)."""
    from laswrr.services.nats_server import free_port
    from laswrr.services.operator import OperatorError, open_connection

    nowhere = f"nats://127.0.0.1:{free_port()}"  # stands for the default (4222 has a system NATS here)
    monkeypatch.setattr(settings, "DEFAULT_NATS_URL", nowhere)
    monkeypatch.delenv("NATS_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OperatorError, match=re.escape("export $(cat <data-dir>/secrets/operator.env)")):
        await open_connection(nowhere)
    (tmp_path / ".laswrr" / "secrets").mkdir(parents=True)
    (tmp_path / ".laswrr" / "secrets" / "operator.env").write_text("NATS_URL=nats://operator:pw@127.0.0.1:1\n")
    with pytest.raises(OperatorError, match=re.escape("export $(cat .laswrr/secrets/operator.env)")):
        await open_connection(nowhere)
    monkeypatch.setenv("NATS_URL", nowhere)  # a URL the user chose: no hint
    with pytest.raises(OperatorError) as raised:
        await open_connection(nowhere)
    assert "export" not in str(raised.value)


def test_every_scheduler_key_is_in_the_configuration_doc() -> None:
    """Issue 43 item 7: `laswrr config --help` sends the reader to docs/configuration.md."""
    from laswrr.scheduler.config import SchedulerConfig, keys

    text = (ROOT / "docs" / "configuration.md").read_text()
    assert [key for key, *_ in keys()] == list(SchedulerConfig.__struct_fields__)
    assert [key for key in SchedulerConfig.__struct_fields__ if f"| `{key}` |" not in text] == []
