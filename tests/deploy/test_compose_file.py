"""compose.yaml, deploy/nodes.compose.toml, the Dockerfile and .dockerignore, checked without Docker.

`docker-compose config` validates the file against the Compose schema when the command is
installed (.ci/run installs Debian's package); the structural tests below run everywhere and say
what the deployment promises: JetStream with a volume and a monitored health check, two scheduler
replicas with distinct ids, one recorder with its volume, two proxies on distinct ports, the
simulated engines only under the ``sim`` profile, a health check and restart policy for every
long-running service, and every command a real ``laswrr`` sub-command with options it accepts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from laswrr.collectors.nodes import load_nodes
from deploy.compose_plan import container_ports, health_test, interpolate, load_compose, selected_services
from laswrr.cli import build_parser
from laswrr.services.accounts import ROLES, compose_config
from laswrr.services.operator import nodes_file_bodies

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
NODES = ROOT / "deploy" / "nodes.compose.toml"
PASSWORDS = {f"LASWRR_NATS_PASSWORD_{role.upper()}": f"pw-{role}" for role in ROLES}  # what .env must set
CORE = {"nats", "scheduler-a", "scheduler-b", "recorder", "collector", "register", "proxy-a", "proxy-b"}
SIMS = {"sim-910c", "sim-910b-1", "sim-910b-2", "sim-910"}
OBSERVABILITY = {"prometheus", "grafana", "dashboard"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose(COMPOSE, PASSWORDS)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return dict(compose["services"])


def laswrr_services(services: dict[str, Any]) -> dict[str, Any]:
    return {name: spec for name, spec in services.items() if "build" in spec}


# -- docker-compose, when installed ---------------------------------------------------------------


@pytest.mark.parametrize("profile", [None, "sim", "observability"])
def test_docker_compose_config_accepts_the_file(profile: str | None) -> None:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose not installed (.ci/run installs it); the structural tests still run")
    args = ["docker-compose", "-f", str(COMPOSE)] + (["--profile", profile] if profile else [])
    env = {**os.environ, **PASSWORDS}
    quiet = subprocess.run([*args, "config", "-q"], capture_output=True, text=True, timeout=60, env=env)
    assert quiet.returncode == 0, quiet.stderr
    listed = subprocess.run([*args, "config", "--services"], capture_output=True, text=True, timeout=60, env=env)
    # docker-compose 1.x lists profiled services even without --profile; `docker compose` v2 does not
    assert CORE <= set(listed.stdout.split()) <= CORE | SIMS | OBSERVABILITY
    if profile:
        assert set(listed.stdout.split()) >= CORE | (SIMS if profile == "sim" else OBSERVABILITY)


def test_docker_compose_config_rejects_a_broken_file(tmp_path: Path) -> None:
    """The validation above can fail: a misspelt key is refused."""
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose not installed")
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE.read_text().replace("    restart: unless-stopped\n", "    restarts: unless-stopped\n", 1))
    result = subprocess.run(["docker-compose", "-f", str(broken), "config", "-q"], capture_output=True, text=True,
                            timeout=60, env={**os.environ, **PASSWORDS})
    assert result.returncode != 0 and "restarts" in result.stderr


# -- structure -------------------------------------------------------------------------------------


def test_services_and_profiles(compose: dict[str, Any]) -> None:
    assert set(selected_services(compose)) == CORE
    assert set(selected_services(compose, ["sim"])) == CORE | SIMS
    assert set(selected_services(compose, ["observability"])) == CORE | OBSERVABILITY
    for name in SIMS:
        assert compose["services"][name]["profiles"] == ["sim"]


def test_nats_runs_jetstream_on_a_named_volume_with_monitoring(services: dict[str, Any]) -> None:
    nats = services["nats"]
    assert nats["image"].startswith("nats:2.10")
    command = nats["command"]
    assert "-js" in command and command[command.index("-sd") + 1] == "/data"
    assert command[command.index("-m") + 1] == "8222" and 8222 in container_ports(nats)
    assert "nats-data:/data" in nats["volumes"]
    assert "http://127.0.0.1:8222/healthz" in " ".join(health_test(nats) or [])


def test_two_active_active_schedulers_with_distinct_replica_ids(services: dict[str, Any]) -> None:
    ids = [spec["command"][spec["command"].index("--replica-id") + 1]
           for name, spec in services.items() if spec.get("command", [None])[0] == "scheduler"]
    assert sorted(ids) == ["a", "b"]


def test_one_recorder_writes_to_its_volume(services: dict[str, Any]) -> None:
    recorders = [spec for spec in services.values() if spec.get("command", [None])[0] == "recorder"]
    assert len(recorders) == 1, "one writer per DuckDB file"
    command = recorders[0]["command"]
    assert command[command.index("--data-dir") + 1] == "/data"
    assert "recorder-data:/data" in recorders[0]["volumes"]


def test_collector_and_register_read_the_mounted_nodes_file(services: dict[str, Any]) -> None:
    for name in ("collector", "register"):
        spec = services[name]
        assert "./deploy/nodes.compose.toml:/etc/laswrr/nodes.toml:ro" in spec["volumes"]
        assert spec["command"][spec["command"].index("--nodes") + 1] == "/etc/laswrr/nodes.toml"
    assert services["register"]["depends_on"]["scheduler-a"]["condition"] == "service_healthy"
    assert services["register"]["restart"].startswith("on-failure")


def test_two_proxies_on_distinct_published_ports(services: dict[str, Any]) -> None:
    proxies = {n: s for n, s in services.items() if s.get("command", [None])[0] == "proxy"}
    assert set(proxies) == {"proxy-a", "proxy-b"}
    published = sorted(s["ports"][0].split(":")[0] for s in proxies.values())
    assert published == ["8000", "8001"]
    assert {s["command"][s["command"].index("--proxy-id") + 1] for s in proxies.values()} == {"proxy-a", "proxy-b"}
    for name, spec in proxies.items():  # healthy = ready to route, not merely alive
        assert health_test(spec)[-1] == "http://127.0.0.1:8000/readiness", name


def test_health_checks_restart_policies_and_environment(services: dict[str, Any], compose: dict[str, Any]) -> None:
    for name, spec in services.items():
        if name == "register":
            assert health_test(spec) is None  # a one-shot: its exit code is its health
            continue
        assert health_test(spec), f"{name} has no health check"
        assert spec["restart"] == "unless-stopped", name
    roles = {"scheduler-a": "scheduler", "scheduler-b": "scheduler", "recorder": "recorder", "collector": "collector",
             "register": "operator", "proxy-a": "proxy", "proxy-b": "proxy", "dashboard": "viewer"}
    for name, spec in laswrr_services(services).items():
        if name in roles:  # each service is its role's NATS user; the simulated engines use no NATS
            assert spec["environment"]["NATS_URL"] == f"nats://{roles[name]}:pw-{roles[name]}@nats:4222", name
        else:
            assert "NATS_URL" not in spec["environment"], name
        assert spec["image"] == "laswrr:latest" and spec["init"] is True
    assert set(compose["volumes"]) == {"nats-data", "recorder-data", "prometheus-data", "grafana-data"}


def test_environment_variables_reach_the_commands() -> None:
    env = {**PASSWORDS, "NATS_ADDRESS": "bus.example:4222", "PROXY_A_PORT": "9000", "TICK_MS": "50", "SIM_SPEED": "20",
           "LASWRR_NODES": "/etc/fleet/nodes.toml", "PROXY_POLICY": "p2c"}
    services = load_compose(COMPOSE, env)["services"]
    assert services["scheduler-a"]["environment"]["NATS_URL"] == "nats://scheduler:pw-scheduler@bus.example:4222"
    command = services["scheduler-a"]["command"]
    assert command[command.index("--tick-ms") + 1] == "50"
    assert services["proxy-a"]["ports"] == ["9000:8000"]
    assert services["proxy-b"]["command"][-1] == "p2c"
    assert services["collector"]["volumes"] == ["/etc/fleet/nodes.toml:/etc/laswrr/nodes.toml:ro"]
    assert services["sim-910"]["command"][-1] == "20"


def test_interpolation_follows_compose_rules() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} $$HOME ${SET:+alt} $SET", env) == "x d  d $HOME alt x"
    with pytest.raises(ValueError, match="NEEDED"):
        interpolate("${NEEDED:?set it}", env)


# -- every command is a real laswrr sub-command --------------------------------------------------


@pytest.mark.parametrize("env", [{}, {"TICK_MS": "0", "SIM_SPEED": "2.5", "PROXY_POLICY": "rr",
                                      "COLLECT_INTERVAL_MS": "250", "NPU_INTERVAL_MS": "5000"}])
def test_every_command_parses_as_a_laswrr_subcommand(env: dict[str, str]) -> None:
    parser = build_parser()
    services = load_compose(COMPOSE, {**PASSWORDS, **env})["services"]
    for name, spec in laswrr_services(services).items():
        args = parser.parse_args(spec["command"])  # argparse exits (SystemExit) on anything unknown
        assert args.command == spec["command"][0] and callable(args.func), name


def test_a_wrong_option_in_a_command_would_be_caught() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["scheduler", "--replicas", "a", "--tick-ms", "100"])


def test_health_checks_name_files_the_image_has() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    services = load_compose(COMPOSE, PASSWORDS)["services"]
    for name, spec in laswrr_services(services).items():
        test = health_test(spec)
        if test is None:
            continue
        script = test[2]
        assert script == "/app/deploy/healthcheck.py" and (ROOT / "deploy" / "healthcheck.py").is_file(), name
        assert "COPY deploy/healthcheck.py" in dockerfile and "WORKDIR /app" in dockerfile


# -- the nodes file ----------------------------------------------------------------------------------


def test_nodes_file_names_the_simulated_engines(services: dict[str, Any]) -> None:
    collector_nodes, warnings = load_nodes(NODES)
    assert warnings == []
    bodies = nodes_file_bodies(str(NODES))
    assert [subject for subject, _ in bodies] == [f"lb.admin.node.{n.id}" for n in collector_nodes]
    for node in collector_nodes:
        host, port = urlsplit(node.url).hostname, urlsplit(node.url).port
        assert host in SIMS and port in container_ports(services[host]), node.url
        sim = services[host]["command"]
        table = next(t for t in tomllib.loads(NODES.read_text())["node"] if t["id"] == node.id)
        assert sim[sim.index("--capacity") + 1] == str(table["capacity"])
        assert sim[sim.index("--chip") + 1] == table["chip"]
        assert node.npu_smi is not None and node.url in node.npu_smi


# -- Dockerfile and .dockerignore --------------------------------------------------------------------


def test_dockerfile_builds_one_non_root_image_for_every_service() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.M)
    assert re.search(r"^USER laswrr$", dockerfile, re.M) and "useradd" in dockerfile
    assert re.search(r'^ENTRYPOINT \["laswrr"\]$', dockerfile, re.M)
    assert len(re.findall(r"^RUN pip install \.", dockerfile, re.M)) == 1
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = pyproject["tool"]["setuptools"]
    folders = {setuptools["package-dir"].get(p, p.replace(".", "/")).split("/")[0] for p in setuptools["packages"]}
    copied = re.findall(r"^COPY (\S+) ", dockerfile, re.M)
    for folder in sorted(folders):
        assert folder in copied, f"Dockerfile does not copy package folder {folder}"
    assert "README.md" in dockerfile  # pyproject's readme: pip install . needs it


def test_dockerignore_keeps_local_state_out_of_the_context() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", ".laswrr", "demo-out", ".pytest_cache", ".hypothesis", "**/__pycache__", ".git"} <= ignored
    copied = re.findall(r"^COPY (\S+) ", (ROOT / "Dockerfile").read_text(), re.M)
    assert not any(c.split("/")[0] in ignored for c in copied)


def test_nats_runs_the_generated_accounts_and_needs_every_password(services: dict[str, Any]) -> None:
    nats = services["nats"]
    command = nats["command"]
    assert command[command.index("-c") + 1] == "/etc/nats/nats-server.conf"
    assert "./deploy/nats-server.conf:/etc/nats/nats-server.conf:ro" in nats["volumes"]
    assert nats["environment"] == PASSWORDS
    assert (ROOT / "deploy" / "nats-server.conf").read_text() == compose_config()
    for missing in PASSWORDS:
        with pytest.raises(ValueError, match="set the NATS passwords"):
            load_compose(COMPOSE, {k: v for k, v in PASSWORDS.items() if k != missing})


def test_compose_yaml_is_plain_yaml() -> None:
    raw = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(raw["services"], dict) and "version" not in raw
