"""compose.yaml's "observability" profile, checked without Docker: Prometheus scrapes the port
each laswrr service really serves /metrics on, Grafana is provisioned with that Prometheus and
deploy/grafana/dashboards/laswrr.json, and every metric the dashboard queries is one the code
exports (its name is spelled in the services' code)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.compose_plan import container_ports, load_compose
from laswrr.cli import build_parser
from laswrr.services.accounts import ROLES

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "laswrr.json"
PASSWORDS = {f"LASWRR_NATS_PASSWORD_{role.upper()}": f"pw-{role}" for role in ROLES}  # compose requires them


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return dict(load_compose(ROOT / "compose.yaml", PASSWORDS)["services"])


def mounted(spec: dict[str, Any], target: str) -> Path:
    for volume in spec["volumes"]:
        source, _, rest = volume.partition(":")
        if rest.split(":")[0] == target:
            return ROOT / source
    raise AssertionError(f"nothing mounted at {target}")


def metrics_port(spec: dict[str, Any]) -> int | None:
    """The port this laswrr service serves /metrics on, from its parsed command."""
    args = build_parser().parse_args(spec["command"])
    if spec["command"][0] == "proxy":
        return int(args.port)
    return getattr(args, "metrics_port", None)


def test_prometheus_scrapes_every_laswrr_metrics_port(services: dict[str, Any]) -> None:
    prometheus = services["prometheus"]
    config = yaml.safe_load(mounted(prometheus, "/etc/prometheus/prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    expected = set()
    for name, spec in services.items():
        if "build" in spec and not spec.get("profiles") and spec["command"][0] != "register":
            port = metrics_port(spec)
            assert port is not None, f"{name} serves no /metrics"
            assert port in container_ports(spec), f"{name}: /metrics port {port} not exposed"
            expected.add(f"{name}:{port}")
    assert targets == expected
    assert "prometheus-data:/prometheus" in prometheus["volumes"]


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(services: dict[str, Any]) -> None:
    grafana = services["grafana"]
    provisioning = mounted(grafana, "/etc/grafana/provisioning")
    (source,) = yaml.safe_load((provisioning / "datasources" / "laswrr.yml").read_text())["datasources"]
    assert source["url"] == f"http://prometheus:{container_ports(services['prometheus'])[0]}"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "laswrr.yml").read_text())["providers"]
    assert mounted(grafana, provider["options"]["path"]) == DASHBOARD.parent
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {p["datasource"]["uid"] for p in dashboard["panels"]}
    uids |= {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert uids == {source["uid"]}
    assert all(p["gridPos"]["w"] > 0 and p["targets"] for p in dashboard["panels"])


def exported_families() -> set[str]:
    """Metric family names spelled in the services' code (prometheus_client adds ``_total`` to a
    counter's name and ``_bucket``/``_sum``/``_count`` to a histogram's)."""
    names: set[str] = set()
    for folder in ("services", "collectors"):
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(re.findall(r'"(laswrr_[a-z_]+)"', path.read_text()))
    names |= {f"laswrr_collector_{metric}" for metric in re.findall(  # the collector's, built from _HELP keys
        r'^    "([a-z_]+)": "', (ROOT / "collectors" / "poller.py").read_text(), re.M)}
    return names


def test_every_queried_metric_is_exported() -> None:
    families = exported_families()
    assert {"laswrr_node_effective_weight", "laswrr_proxy_responses", "laswrr_scheduler_lag_seconds",
            "laswrr_recorder_rows_written", "laswrr_collector_scrapes"} <= families
    dashboard = json.loads(DASHBOARD.read_text())
    queried = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\b(laswrr_[a-z_]+)", target["expr"]):
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                assert {base, base.removesuffix("_total")} & families, f"{panel['title']!r} queries {name}: not exported"
                queried.add(base.removesuffix("_total"))
    for routing in ("effective_weight", "target_weight", "phase", "routable", "inflight"):
        assert f"laswrr_node_{routing}" in queried
