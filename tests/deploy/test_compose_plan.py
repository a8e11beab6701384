"""deploy/compose_plan.py: the pure translation of a compose file into local processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.compose_plan import ComposeError, Runtime, plan, restart_policy, selected_services

RUNTIME = Runtime(build_context=Path("/repo"), laswrr=("/venv/bin/laswrr",), python="/venv/bin/python",
                  nats_server="/venv/bin/nats-server")

DOC = """
services:
  bus:
    image: nats:2.10-alpine
    command: ["-js", "-sd", "/data", "-p", "4222", "-m", "8222"]
    volumes: [store:/data]
    expose: ["4222", "8222"]
    healthcheck: {test: ["CMD", "wget", "-q", "-O", "-", "http://127.0.0.1:8222/healthz"]}
  api:
    build: .
    command: ["proxy", "--port", "8000", "--metrics-port=9100", "--capacity", "8000"]
    environment: {NATS_URL: "nats://bus:4222", PEER: "http://engine:8000/v1", SELF: "http://localhost:8000"}
    ports: ["127.0.0.1:18000:8000/tcp"]
    expose: ["9100"]
    volumes: ["./nodes.toml:/etc/laswrr/nodes.toml:ro", "logs:/var/log/laswrr"]
    depends_on: {bus: {condition: service_healthy}}
    healthcheck: {test: ["CMD", "python", "/app/deploy/healthcheck.py", "http", "http://127.0.0.1:8000/healthz"]}
    restart: unless-stopped
    deploy: {replicas: 2}
  engine:
    build: .
    profiles: [sim]
    command: ["sim-engine", "--port", "8000", "--node-id", "engine"]
    expose: ["8000"]
  once:
    build: .
    command: ["register", "--nodes", "/etc/laswrr/nodes.toml", "--log", "/var/log/laswrr/x"]
    restart: on-failure:2
    volumes: ["./nodes.toml:/etc/laswrr/nodes.toml:ro", "logs:/var/log/laswrr"]
    depends_on: [api]
"""


@pytest.fixture
def compose_dir(tmp_path: Path) -> Path:
    (tmp_path / "nodes.toml").write_text('[[node]]\nid = "e"\nurl = "http://engine:8000"\nnpu_smi = "x --url http://engine:8000"\n')
    return tmp_path


def make(compose_dir: Path, profiles: list[str]) -> dict[str, Any]:
    ports = iter(range(30000, 30100))
    plans = plan(yaml.safe_load(DOC), compose_dir, Path("/work"), RUNTIME, profiles, lambda: next(ports))
    return {p.name: p for p in plans}


def test_services_follow_profiles_and_dependencies() -> None:
    document = yaml.safe_load(DOC)
    assert selected_services(document) == ["bus", "api", "once"]
    assert selected_services(document, ["sim"]) == ["bus", "api", "engine", "once"]
    document["services"]["api"]["depends_on"] = ["engine"]
    with pytest.raises(ComposeError, match="not enabled"):
        selected_services(document)
    document["services"]["engine"]["depends_on"] = ["api"]
    with pytest.raises(ComposeError, match="cycle"):
        selected_services(document, ["sim"])


def test_ports_hosts_volumes_and_programs_are_translated(compose_dir: Path) -> None:
    plans = make(compose_dir, ["sim"])
    assert list(plans) == ["bus", "api-1", "api-2", "engine", "once"]
    bus, api1, api2, engine = plans["bus"], plans["api-1"], plans["api-2"], plans["engine"]
    assert bus.argv == ["/venv/bin/nats-server", "-js", "-sd", "/work/volumes/store",
                        "-p", str(bus.ports[4222]), "-m", str(bus.ports[8222])]
    assert bus.health is not None and bus.health.url == f"http://127.0.0.1:{bus.ports[8222]}/healthz"
    # own port options rewritten, an unrelated option with the same number left alone
    assert api1.argv == ["/venv/bin/laswrr", "proxy", "--port", str(api1.ports[8000]),
                         f"--metrics-port={api1.ports[9100]}", "--capacity", "8000"]
    assert api1.ports[8000] != api2.ports[8000]
    assert api1.env["NATS_URL"] == f"nats://127.0.0.1:{bus.ports[4222]}"
    assert api1.env["PEER"] == f"http://127.0.0.1:{engine.ports[8000]}/v1"
    assert api2.env["SELF"] == f"http://127.0.0.1:{api2.ports[8000]}"
    assert api1.health is not None and api1.health.argv == (
        "/venv/bin/python", "/repo/deploy/healthcheck.py", "http", f"http://127.0.0.1:{api1.ports[8000]}/healthz")
    (mounted, text), = api1.files.items()
    assert mounted == Path("/work/mounts/api-1/nodes.toml")
    assert f'url = "http://127.0.0.1:{engine.ports[8000]}"' in text and f"x --url http://127.0.0.1:{engine.ports[8000]}" in text
    assert api1.depends == {"bus": "service_healthy"} and not api1.one_shot
    once = plans["once"]
    assert once.argv[2:] == ["--nodes", "/work/mounts/once/nodes.toml", "--log", "/work/volumes/logs/x"]
    assert once.depends == {"api-1": "service_started", "api-2": "service_started"}
    assert (once.one_shot, once.retries) == (True, 2)


def test_restart_policies() -> None:
    assert restart_policy({}) == (True, 0)
    assert restart_policy({"restart": "on-failure"}) == (True, 3)
    assert restart_policy({"restart": "on-failure:5"}) == (True, 5)
    assert restart_policy({"restart": "unless-stopped"}) == (False, 0)
    assert restart_policy({"restart": "always"}) == (False, 0)


def test_unsupported_images_and_missing_mounts_are_clear_errors(compose_dir: Path) -> None:
    document = yaml.safe_load(DOC)
    document["services"]["bus"]["image"] = "redis:7"
    with pytest.raises(ComposeError, match="redis:7"):
        plan(document, compose_dir, Path("/work"), RUNTIME)
    (compose_dir / "nodes.toml").unlink()
    with pytest.raises(ComposeError, match="nodes.toml"):
        make(compose_dir, [])
