"""nodes.toml as the collector reads it (defaults, chip selectors, one-line errors, warnings), and the
same validation errors for `laswrr up --nodes` and `laswrr register --nodes`."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from laswrr.collectors.nodes import Node, NodesConfigError, load_nodes, parse_nodes
from laswrr.collectors.npu import ChipSelector, select_chips
from laswrr.schemas.codec import decode_event, encode
from laswrr.schemas.events import NodeRegistered, NpuChip
from laswrr.schemas.words import NodeRole, PdProtocol


def parse(text: str) -> tuple[list[Node], list[str]]:
    return parse_nodes(tomllib.loads(text))


def test_defaults_from_the_up_keys_alone() -> None:
    (node,), warnings = parse('[[node]]\nid = "n1"\nurl = "http://10.0.0.5:8000/"\npool = "p"\nchip = "910B"\ncapacity = 8\n')
    assert node == Node(id="n1", url="http://10.0.0.5:8000", pool="p", chip="910B", capacity=8,
                        metrics_url="http://10.0.0.5:8000/metrics", health_url="http://10.0.0.5:8000/health",
                        engine="auto", npu_smi=None, selector=ChipSelector())
    assert warnings == []


def test_collector_keys() -> None:
    (a, b), _ = parse("""
[[node]]
id = "a"
url = "http://h:1025"
metrics_url = "http://h:1026/metrics"
health_url = "https://h:1026/health"
engine = "mindie"
npu_ids = [0, 1]
[[node]]
id = "b"
url = "http://h:1027"
npu_smi = "ssh h npu-smi info"
chips = [[2, 0], [2, 1]]
""")
    assert (a.metrics_url, a.health_url, a.engine) == ("http://h:1026/metrics", "https://h:1026/health", "mindie")
    assert a.npu_smi == "npu-smi info" and a.selector == ChipSelector(npu_ids=(0, 1))  # default command with ids
    assert b.npu_smi == "ssh h npu-smi info" and b.selector == ChipSelector(chips=((2, 0), (2, 1)))


def test_selectors_pick_chips_and_name_missing_ones() -> None:
    chips = [NpuChip(npu_id=n, chip_id=c) for n in (0, 1, 2) for c in (0, 1)]
    both = ChipSelector(npu_ids=(1,), chips=((2, 1), (5, 0)))
    assert [(c.npu_id, c.chip_id) for c in select_chips(chips, both)] == [(1, 0), (1, 1), (2, 1)]
    assert both.missing(chips) == ["chip 5/0"]
    assert ChipSelector(npu_ids=(9,)).missing(chips) == ["npu 9"]
    assert select_chips(chips, ChipSelector()) == chips


@pytest.mark.parametrize(("body", "message"), [
    ('[[node]]\nid = "n 1"\nurl = "http://h:1"\n', "node #1: invalid node id 'n 1': use 1-128 letters, digits, '-' or '_'"),
    ('[[node]]\nid = 3\nurl = "http://h:1"\n', "node #1: id must be a string"),
    ('[[node]]\nid = "a"\n', "node 'a': url must be a non-empty string"),
    ('[[node]]\nid = "a"\nurl = "h:1"\n', "node 'a': url 'h:1' is not an http(s) URL with a host"),
    ('[[node]]\nid = "a"\nurl = "http://h:1"\nengine = "trt"\n', "node 'a': engine must be one of auto, vllm, mindie, sglang, got 'trt'"),
    ('[[node]]\nid = "a"\nurl = "http://h:1"\nnpu_ids = [-1]\n', "node 'a': npu_ids must be a list of integers >= 0, got [-1]"),
    ('[[node]]\nid = "a"\nurl = "http://h:1"\nchips = [[1]]\n', "node 'a': chips entry must be a pair [npu_id, chip_id], got [1]"),
    ('[[node]]\nid = "a"\nurl = "http://h:1"\nnpu_smi = "npu-smi \'info"\n', "node 'a': npu_smi \"npu-smi 'info\": No closing quotation"),
    ('[[node]]\nid = "a"\nurl = "http://h:1"\nnpu_smi = "  "\n', "node 'a': npu_smi must be a non-empty command line"),
    ('[[node]]\nid = "a"\nurl = "http://h:1"\n[[node]]\nid = "a"\nurl = "http://h:2"\n', "node 'a' is defined twice"),
    ('[node]\nid = "a"\nurl = "http://h:1"\n', "'node' must be an array of tables: write [[node]], not [node]"),
])
def test_bad_nodes_give_one_line_errors(body: str, message: str) -> None:
    with pytest.raises(NodesConfigError) as caught:
        parse(body)
    assert str(caught.value) == message


def test_an_unknown_key_is_refused_naming_the_known_ones_and_shared_hosts_warn() -> None:
    with pytest.raises(NodesConfigError) as refused:  # a typo is never kept and ignored
        parse("""
[[node]]
id = "a"
url = "http://h:1"
statusurl = "http://h:1/v1/status"
""")
    text = str(refused.value)
    assert text.startswith("node 'a': unknown key 'statusurl' (did you mean 'status_url'?); a [[node]] takes ")
    assert "capacity" in text and "npu_exporter" in text
    nodes, warnings = parse("""
[[node]]
id = "a"
url = "http://h:1"
npu_smi = "npu-smi info"
[[node]]
id = "b"
url = "http://h:2"
npu_smi = "npu-smi info"
npu_ids = [1]
""")
    assert len(nodes) == 2
    assert warnings == [
        "nodes a, b share npu_smi 'npu-smi info' but not all name their npu_ids/chips: those get every chip",
    ]


def test_load_nodes_reports_the_file(tmp_path: Path) -> None:
    with pytest.raises(NodesConfigError, match=r"^cannot read .*missing\.toml: No such file or directory$"):
        load_nodes(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[[node]\n")
    with pytest.raises(NodesConfigError, match=r"bad\.toml is not valid TOML: "):
        load_nodes(bad)
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    assert load_nodes(empty) == ([], [])


@pytest.mark.parametrize(("body", "message"), [
    ('[[node]]\nid = "a"\nurl = "http://h:1"\ncapacity = 2\nengine = "trt"\n', "node 'a': engine must be one of"),
    ('[[node]]\nid = "a"\nurl = "http://h:1"\ncapacity = 2\npool = "p q"\n', "node 'a': invalid pool name 'p q'"),
    ('[[node]]\nid = "a"\nurl = "http://h:1"\ncapacity = 0\n', "node 'a': capacity must be an integer > 0, got 0"),
    ('[[node]]\nid = "a"\nurl = "http://h:1"\ncapacity = 2\nchip = 910\n', "node 'a': chip must be a non-empty string"),
])
def test_collector_up_and_register_reject_a_file_with_the_same_error(tmp_path: Path, body: str, message: str) -> None:
    from laswrr.services.operator import OperatorError, nodes_file_bodies
    from laswrr.services.up import StackError
    from laswrr.services.up import load_nodes as up_load_nodes

    path = tmp_path / "nodes.toml"
    path.write_text(body)
    errors = []
    for load, error in ((load_nodes, NodesConfigError), (up_load_nodes, StackError), (nodes_file_bodies, OperatorError)):
        with pytest.raises(error) as caught:
            load(str(path))  # type: ignore[operator]
        errors.append(str(caught.value))
    assert errors[0].startswith(f"{path}: {message}") and errors == errors[:1] * 3


def test_registration_needs_a_capacity_the_collector_does_not(tmp_path: Path) -> None:
    from laswrr.services.operator import OperatorError, nodes_file_bodies

    path = tmp_path / "nodes.toml"
    path.write_text('[[node]]\nid = "a"\nurl = "http://h:1/"\n')
    assert [n.url for n in load_nodes(path)[0]] == ["http://h:1"]
    with pytest.raises(OperatorError, match=r"node 'a': capacity must be an integer > 0, none given$"):
        nodes_file_bodies(str(path))


def test_registration_is_the_lb_admin_node_body_with_only_what_was_given() -> None:
    (full, bare), _ = parse("""
[[node]]
id = "a"
url = "http://h:1"
pool = "p"
chip = "910B"
capacity = 8
health_url = "http://h:2/health"
engine = "mindie"
npu_ids = [0]
[[node]]
id = "b"
url = "http://h:3"
capacity = 2
""")
    assert full.registration() == NodeRegistered(url="http://h:1", pool="p", chip="910B", capacity=8,
                                                 health_url="http://h:2/health", engine="mindie")
    # nothing but what was given: a key left out stays None (the collector's own file then counts)
    assert bare.registration() == NodeRegistered(url="http://h:3", pool="default", capacity=2)
    assert decode_event("lb.admin.node.b", encode(bare.registration())) == ("b", bare.registration())
    with pytest.raises(NodesConfigError, match="capacity must be given"):
        Node(id="c", url="http://h:4").registration()


def test_role_and_pd_protocol_are_registered_and_checked() -> None:
    (prefill, both), warnings = parse("""
[[node]]
id = "p1"
url = "http://h:1"
capacity = 4
role = "prefill"
pd_protocol = "vllm"
[[node]]
id = "b1"
url = "http://h:2"
capacity = 4
role = "both"
""")
    assert warnings == []
    assert prefill.registration() == NodeRegistered(url="http://h:1", pool="default", capacity=4,
                                                    role=NodeRole.PREFILL, pd_protocol=PdProtocol.VLLM)
    assert both.registration() == NodeRegistered(url="http://h:2", pool="default", capacity=4)
    with pytest.raises(NodesConfigError, match="node 'd1': a decode node needs pd_protocol"):
        parse('[[node]]\nid = "d1"\nurl = "http://h:1"\nrole = "decode"\n')
    with pytest.raises(NodesConfigError, match="node 'd1': role must be one of both, prefill, decode, got 'leader'"):
        parse('[[node]]\nid = "d1"\nurl = "http://h:1"\nrole = "leader"\n')
    with pytest.raises(NodesConfigError, match="pd_protocol must be one of vllm, sglang"):
        parse('[[node]]\nid = "d1"\nurl = "http://h:1"\nrole = "decode"\npd_protocol = "mooncake"\n')


def test_an_sglang_prefill_node_names_its_bootstrap_port() -> None:
    (prefill,), warnings = parse('[[node]]\nid = "p1"\nurl = "http://h:1"\ncapacity = 4\nrole = "prefill"\n'
                                 'pd_protocol = "sglang"\nbootstrap_port = 8998\n')
    assert warnings == [] and prefill.registration() == NodeRegistered(
        url="http://h:1", pool="default", capacity=4, role=NodeRole.PREFILL, pd_protocol=PdProtocol.SGLANG,
        bootstrap_port=8998)
    with pytest.raises(NodesConfigError, match="node 'p1': an sglang prefill node needs bootstrap_port"):
        parse('[[node]]\nid = "p1"\nurl = "http://h:1"\nrole = "prefill"\npd_protocol = "sglang"\n')
    with pytest.raises(NodesConfigError, match="node 'd1': bootstrap_port is only for an sglang prefill node"):
        parse('[[node]]\nid = "d1"\nurl = "http://h:1"\nrole = "decode"\npd_protocol = "sglang"\nbootstrap_port = 1\n')
    with pytest.raises(NodesConfigError, match="bootstrap_port must be a port number 1..65535, got 0"):
        parse('[[node]]\nid = "p1"\nurl = "http://h:1"\nrole = "prefill"\npd_protocol = "sglang"\nbootstrap_port = 0\n')
