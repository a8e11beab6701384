"""`laswrr register --nodes FILE`: the compose one-shot that registers every node of nodes.toml.

The happy path runs in test_compose_topology (the `register` service against real schedulers);
here: the file's errors are one-line usage errors (exit 2) before anything is published.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from laswrr.schemas.events import NodeRegistered
from laswrr.schemas.words import NodeRole, PdProtocol
from laswrr.services.operator import OperatorError, nodes_file_bodies


def register(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "laswrr", "register", *args, "--nats-url",
                           "nats://127.0.0.1:1"], capture_output=True, text=True, timeout=20)


def test_bodies_are_what_lb_admin_node_takes(tmp_path: Path) -> None:
    nodes = tmp_path / "nodes.toml"
    nodes.write_text('[[node]]\nid = "n1"\nurl = "http://10.0.0.5:8000"\nchip = "910B"\ncapacity = 8\n'
                     'metrics_url = "http://10.0.0.5:8000/metrics"\n'
                     '[[node]]\nid = "n2"\nurl = "http://10.0.0.6:1025"\npool = "mindie"\ncapacity = 16\n')
    assert nodes_file_bodies(str(nodes)) == [
        ("lb.admin.node.n1", NodeRegistered(url="http://10.0.0.5:8000", pool="default", chip="910B", capacity=8,
                                            metrics_url="http://10.0.0.5:8000/metrics")),
        ("lb.admin.node.n2", NodeRegistered(url="http://10.0.0.6:1025", pool="mindie", capacity=16)),
    ]


@pytest.mark.parametrize("text, message", [
    ("[[node]]\nid = 'n1'\nurl = 'http://a:1'\n", "node 'n1': capacity must be an integer > 0"),
    ("[[node]]\nid = 'n.1'\nurl = 'http://a:1'\ncapacity = 1\n", "invalid node id 'n.1'"),
    ("[node]\nid = 'n1'\n", "write [[node]], not [node]"),
    ("", "no [[node]] tables"),
    ("not toml = = =", "is not valid TOML"),
])
def test_bad_files_are_rejected_before_publishing(tmp_path: Path, text: str, message: str) -> None:
    nodes = tmp_path / "nodes.toml"
    nodes.write_text(text)
    with pytest.raises(OperatorError, match=re.escape(message)):
        nodes_file_bodies(str(nodes))


def test_cli_errors_are_one_line_usage_errors(tmp_path: Path) -> None:
    nodes = tmp_path / "nodes.toml"
    nodes.write_text("[[node]]\nid = 'n1'\n")
    bad = register("--nodes", str(nodes))
    assert bad.returncode == 2 and "node 'n1': url must be" in bad.stderr and len(bad.stderr.splitlines()) == 1
    mixed = register("n1", "--nodes", str(tmp_path / "nodes.toml"))
    assert mixed.returncode == 2 and "takes no NODE" in mixed.stderr
    incomplete = register("n1", "--url", "http://a:1")
    assert incomplete.returncode == 2 and "needs NODE, --url and --capacity" in incomplete.stderr


def test_register_flags_carry_role_and_pd_protocol() -> None:
    from laswrr.services.operator import _register_body
    from laswrr.cli import build_parser
    # the register command's own parser, so every flag it has (and will have) is in args
    args = build_parser().parse_args(["register", "p1", "--url", "http://10.0.0.5:8000", "--pool", "pd",
                                      "--capacity", "4", "--role", "prefill", "--pd-protocol", "vllm"])
    assert _register_body(args) == NodeRegistered(url="http://10.0.0.5:8000", pool="pd", capacity=4,
                                                  role=NodeRole.PREFILL, pd_protocol=PdProtocol.VLLM)
    args.pd_protocol, args.bootstrap_port = "sglang", 8998
    assert _register_body(args).bootstrap_port == 8998
    missing = register("p1", "--url", "http://a:1", "--capacity", "4", "--role", "decode")
    assert missing.returncode == 2 and missing.stderr.strip() == (
        "laswrr: register --role decode needs --pd-protocol (vllm or sglang)")
    no_port = register("p1", "--url", "http://a:1", "--capacity", "4", "--role", "prefill", "--pd-protocol", "sglang")
    assert no_port.returncode == 2 and "needs --bootstrap-port" in no_port.stderr
    stray = register("d1", "--url", "http://a:1", "--capacity", "4", "--role", "decode", "--pd-protocol", "sglang",
                     "--bootstrap-port", "8998")
    assert stray.returncode == 2 and "only for an sglang prefill node" in stray.stderr
