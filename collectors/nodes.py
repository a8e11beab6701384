"""``nodes.toml``, the one parser: the ``[[node]]`` file ``laswrr up --nodes``, ``laswrr register
--nodes`` and the collector all read, with one set of validation errors.

Each ``[[node]]`` table has ``id`` and ``url``; ``pool`` (default ``"default"``), ``chip`` and
``capacity`` (an integer > 0) are what registration publishes (``lb.admin.node.<id>``), and
registering requires ``capacity``; the collector reads ``id``, ``url`` and these optional keys:

```toml
[[node]]
id = "n1"
url = "http://10.0.0.5:8000"
pool = "default"
chip = "910B"
capacity = 8
role = "both"                   # prefill | decode | both (default); prefill and decode need:
# pd_protocol = "vllm"          # vllm | sglang: the pool's P/D protocol (docs/proxy.md)
# bootstrap_port = 8998         # an sglang prefill node's bootstrap server port (required for one)
# --- collector keys, all optional ---
metrics_url = "http://10.0.0.5:8000/metrics"   # default <url>/metrics
health_url = "http://10.0.0.5:8000/health"     # default <url>/health (MindIE: management port)
engine = "auto"                 # vllm | mindie | sglang | auto (default: detect per scrape)
npu_smi = "npu-smi info"        # command line for this node's host (default "npu-smi info"
                                # when npu_ids/chips are given, else no NPU sampling)
npu_ids = [0, 1]                # whole NPU ids of that table that serve this node, and/or
chips = [[2, 0], [2, 1]]        # exact (npu_id, chip_id) pairs; neither = every chip printed
npu_exporter = "http://10.0.0.5:8082/metrics"  # MindCluster npu-exporter of the host, read
                                # instead of npu_smi (chips by npu_ids/chips or by pod)
chips_per_npu = 1               # 2 on Atlas A3 and 300I Duo: exporter id n is NPU n//2, chip n%2
pod = "default/mindie-0"        # the exporter's namespace/pod_name labels (or just "pod_name")
status_url = "http://10.0.0.5:1026/v1/status"  # MindIE management port: free slots and blocks
# --- for laswrr kv-events (services/kv_events.py), optional ---
kv_events = "tcp://10.0.0.5:5557"          # the engine's KV event publisher (vLLM --kv-events-config)
kv_events_replay = "tcp://10.0.0.5:5558"   # its replay endpoint
```

Nodes with the same ``npu_exporter`` URL share one host: it is scraped once per exporter
refresh (``--exporter-interval-ms``, 5 s like npu-exporter's own ``-updateTime``) and each node
gets its chips. A node naming ``npu_exporter`` is not sampled through ``npu_smi`` (the default
``"npu-smi info"`` that ``npu_ids`` implies is not run; an explicit ``npu_smi`` beside it is a
warning). Without ``status_url`` a MindIE node is read through ``/metrics`` alone and a silent
slot loss is believed only after queue evidence (docs/ascend.md).

Nodes with the same ``npu_smi`` string share one host: the command runs once per interval
and each node gets its selected chips. For a simulated engine the command is
``"<python> -m laswrr sim-npu-smi --url <engine url>"``.

Rules: ``parse_nodes`` is pure (a decoded TOML document in, ``Node``s out) and validates
every known key of every node, whoever reads the file, so a file is valid for all three commands
or for none (except that registering needs ``capacity`` and at least one node:
``registration=True``). Anything wrong raises ``NodesConfigError`` with a one-line message
naming the node (``node #<n>`` until its id is known, then ``node '<id>'``) and the key;
``load_nodes`` adds the file. Unknown keys are returned as warnings, never errors.

``Node`` is the one description of a node: what registration publishes (``registration()``, the
``lb.admin.node.<id>`` body; built here and nowhere else) and how the collector polls it. It
lives in collectors/ so that the collector, ``laswrr up`` and ``laswrr register`` (services/)
all import it from below.
"""

from __future__ import annotations

import tomllib
import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast
from urllib.parse import urlsplit

from laswrr.collectors.npu import ChipSelector, split_command
from laswrr.collectors.prometheus import EngineKind
from laswrr.schemas.events import ENGINE_NAMES, NodeRegistered
from laswrr.schemas.subjects import SubjectError, check_token
from laswrr.schemas.words import NodeRole, PdProtocol

DEFAULT_NPU_SMI = "npu-smi info"
UP_KEYS = frozenset({"id", "url", "pool", "chip", "capacity", "role", "pd_protocol", "bootstrap_port"})
COLLECTOR_KEYS = frozenset({"metrics_url", "health_url", "engine", "npu_smi", "npu_ids", "chips",
                            "npu_exporter", "chips_per_npu", "pod", "status_url", "kv_events", "kv_events_replay"})
# What the collector needs to poll a node registered at runtime (lb.admin.node's last fields).
ROLES = tuple(NodeRole)
PD_PROTOCOLS = tuple(PdProtocol)
REGISTERED_COLLECTOR_KEYS = ("metrics_url", "health_url", "engine", "status_url", "npu_exporter", "kv_events",
                             "kv_events_replay")


class NodesConfigError(ValueError):
    """``nodes.toml`` cannot be used; the message is one line naming the node and the key."""


@dataclass(frozen=True, slots=True)
class Node:
    """One inference engine: its registration (id, url, pool, chip, capacity) and how the
    collector polls it (metrics and health URLs, engine, npu-smi host command and chips).

    ``metrics_url`` and ``health_url`` left empty mean ``<url>/metrics`` and ``<url>/health``.
    ``extra`` holds the ``[[node]]`` table's other keys as written (``laswrr up`` writes them
    back into the collector's nodes.toml; registration forwards the collector keys given there).
    """

    id: str
    url: str  # a parsed file's is without a trailing "/"
    pool: str = "default"
    chip: str | None = None  # None: not given (the scheduler then says "unknown")
    capacity: int | None = None  # None: not given (then the node cannot be registered)
    metrics_url: str = ""
    health_url: str = ""
    engine: EngineKind | Literal["auto"] = "auto"
    npu_smi: str | None = None
    selector: ChipSelector = ChipSelector()
    extra: dict[str, Any] = field(default_factory=dict)  # every key but the up keys, as written
    npu_exporter: str | None = None  # the host's npu-exporter /metrics URL
    chips_per_npu: int = 1  # exporter device ids per NPU id (2: Atlas A3, 300I Duo)
    pod: tuple[str, str] = ("", "")  # (namespace, pod_name) the exporter labels this node's chips with
    status_url: str | None = None  # MindIE /v1/status (or /v2/status) on the management port
    role: NodeRole = NodeRole.BOTH  # prefill | decode | both (docs/proxy.md, "Prefill/decode pairs")
    pd_protocol: PdProtocol | None = None  # the pool's P/D protocol (required for prefill and decode)
    bootstrap_port: int | None = None  # an sglang prefill node's bootstrap server port (required for one)

    def __post_init__(self) -> None:
        if not self.metrics_url:
            object.__setattr__(self, "metrics_url", f"{self.url}/metrics")
        if not self.health_url:
            object.__setattr__(self, "health_url", f"{self.url}/health")

    @property
    def polling(self) -> tuple[Any, ...]:
        """What the collector's polling of this node depends on (a change restarts it)."""
        return (self.id, self.url, self.metrics_url, self.health_url, self.engine, self.npu_smi, self.selector,
                self.npu_exporter, self.chips_per_npu, self.pod, self.status_url)

    def registration(self) -> NodeRegistered:
        """The ``lb.admin.node.<id>`` event (publish it with ``schemas.codec.encode``): url, pool,
        chip when given, capacity, role, and the collector keys (``REGISTERED_COLLECTOR_KEYS``)
        that ``extra`` gives explicitly; a key not given is None, so a registration never
        overrides the collector's own file with a default (``collectors.registrations``)."""
        if self.capacity is None:
            raise NodesConfigError(f"node {self.id!r}: capacity must be given to register it")
        given = {key: self.extra[key] for key in REGISTERED_COLLECTOR_KEYS if self.extra.get(key) is not None}
        chip = {} if self.chip is None else {"chip": self.chip}
        return NodeRegistered(url=self.url, pool=self.pool, capacity=self.capacity, role=self.role,
                              pd_protocol=self.pd_protocol, bootstrap_port=self.bootstrap_port, **chip, **given)


# -- one table --------------------------------------------------------------------------------------


def _string(value: Any, key: str, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise NodesConfigError(f"{where}: {key} must be a non-empty string")
    return value


def _http_url(value: Any, key: str, where: str) -> str:
    url = _string(value, key, where).strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise NodesConfigError(f"{where}: {key} {value!r} is not an http(s) URL with a host")
    return url


def _zmq_url(value: Any, key: str, where: str) -> str:
    url = _string(value, key, where).strip()
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    if not (url.startswith("tcp://") and host and "*" not in host and port.isdigit()) and \
            not (url.startswith("ipc://") and len(url) > 6):
        raise NodesConfigError(f"{where}: {key} {value!r} is not a ZMQ endpoint to connect to (tcp://host:port)")
    return url


def _capacity(value: Any, where: str, required: bool) -> int | None:
    if value is None and not required:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        got = "none given" if value is None else f"got {value!r}"
        raise NodesConfigError(f"{where}: capacity must be an integer > 0, {got}")
    return value


def _nonneg_ints(value: Any, key: str, where: str, size: int | None = None) -> tuple[int, ...]:
    ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    if not ok or (size is not None and len(value) != size):
        shape = "a pair [npu_id, chip_id]" if size == 2 else "a list of integers >= 0"
        raise NodesConfigError(f"{where}: {key} must be {shape}, got {value!r}")
    return tuple(value)


def _selector(table: dict[str, Any], where: str) -> ChipSelector:
    npu_ids = _nonneg_ints(table.get("npu_ids", []), "npu_ids", where)
    raw_chips = table.get("chips", [])
    if not isinstance(raw_chips, list):
        raise NodesConfigError(f"{where}: chips must be a list of [npu_id, chip_id] pairs")
    chips = tuple(cast(tuple[int, int], _nonneg_ints(c, "chips entry", where, size=2)) for c in raw_chips)
    return ChipSelector(npu_ids=npu_ids, chips=chips)


def _npu_smi(table: dict[str, Any], selector: ChipSelector, where: str) -> str | None:
    command = table.get("npu_smi")
    if command is None:
        return None if selector.selects_all else DEFAULT_NPU_SMI
    if not isinstance(command, str):
        raise NodesConfigError(f"{where}: npu_smi must be a command line string")
    try:
        split_command(command)
    except ValueError as exc:
        raise NodesConfigError(f"{where}: {exc}") from None
    return command.strip()


def _pod(value: Any, where: str) -> tuple[str, str]:
    if value is None:
        return ("", "")
    text = _string(value, "pod", where).strip()
    namespace, _, name = text.rpartition("/")
    if not name or "/" in namespace:
        raise NodesConfigError(f"{where}: pod must be \"namespace/pod_name\" or \"pod_name\", got {value!r}")
    return (namespace, name)


def _chips_per_npu(value: Any, where: str) -> int:
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 8:
        raise NodesConfigError(f"{where}: chips_per_npu must be an integer 1..8, got {value!r}")
    return value


def _node_id(table: Any, where: str) -> str:
    if not isinstance(table, dict):
        raise NodesConfigError(f"{where}: expected a [[node]] table")
    node_id = table.get("id")
    if not isinstance(node_id, str):
        raise NodesConfigError(f"{where}: id must be a string")
    try:
        return check_token(node_id)
    except SubjectError as exc:
        raise NodesConfigError(f"{where}: {exc}") from None


def _known_keys(table: dict[str, Any], where: str) -> None:
    """Every key of a ``[[node]]`` table is one this version reads: a typo (``statusurl``) would
    otherwise be kept and ignored. No key is let through with a warning: a key of another
    version is refused too, so a file is never silently half-read."""
    known = UP_KEYS | COLLECTOR_KEYS
    unknown = sorted(set(table) - known)
    if not unknown:
        return
    hints = [f"{key!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(key, known, 1)) else repr(key)
             for key in unknown]
    raise NodesConfigError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; a [[node]] "
                           f"takes {', '.join(sorted(UP_KEYS))} (registration) and {', '.join(sorted(COLLECTOR_KEYS))} "
                           f"(collector)")


def _node(table: Any, index: int, registration: bool) -> Node:
    node_id = _node_id(table, f"node #{index + 1}")
    where = f"node {node_id!r}"
    _known_keys(table, where)
    url = _http_url(table.get("url"), "url", where).rstrip("/")
    try:
        pool = check_token(_string(table.get("pool", "default"), "pool", where), "pool name")
    except SubjectError as exc:
        raise NodesConfigError(f"{where}: {exc}") from None
    chip = None if table.get("chip") is None else _string(table["chip"], "chip", where)
    capacity = _capacity(table.get("capacity"), where, required=registration)
    engine = table.get("engine", "auto")
    if engine not in ENGINE_NAMES:
        raise NodesConfigError(f"{where}: engine must be one of {', '.join(ENGINE_NAMES)}, got {engine!r}")
    role = table.get("role", NodeRole.BOTH)
    if role not in ROLES:
        raise NodesConfigError(f"{where}: role must be one of {', '.join(ROLES)}, got {role!r}")
    role = NodeRole(role)
    protocol = table.get("pd_protocol")
    if protocol is not None and protocol not in PD_PROTOCOLS:
        raise NodesConfigError(f"{where}: pd_protocol must be one of {', '.join(PD_PROTOCOLS)}, got {protocol!r}")
    protocol = None if protocol is None else PdProtocol(protocol)
    if role is not NodeRole.BOTH and protocol is None:
        raise NodesConfigError(f"{where}: a {role} node needs pd_protocol (one of {', '.join(PD_PROTOCOLS)})")
    bootstrap_port = _bootstrap_port(table.get("bootstrap_port"), role, protocol, where)
    selector = _selector(table, where)
    exporter = None if table.get("npu_exporter") is None else _http_url(table["npu_exporter"], "npu_exporter", where)
    for key in ("kv_events", "kv_events_replay"):
        if table.get(key) is not None:
            _zmq_url(table[key], key, where)
    return Node(
        id=node_id, url=url, pool=pool, chip=chip, capacity=capacity,
        metrics_url=_http_url(table.get("metrics_url", f"{url}/metrics"), "metrics_url", where),
        health_url=_http_url(table.get("health_url", f"{url}/health"), "health_url", where),
        engine=engine, npu_smi=None if exporter and "npu_smi" not in table else _npu_smi(table, selector, where),
        selector=selector, extra={k: v for k, v in table.items() if k not in UP_KEYS},
        npu_exporter=exporter, chips_per_npu=_chips_per_npu(table.get("chips_per_npu"), where),
        pod=_pod(table.get("pod"), where),
        status_url=None if table.get("status_url") is None else _http_url(table["status_url"], "status_url", where),
        role=role, pd_protocol=protocol, bootstrap_port=bootstrap_port)


def _bootstrap_port(value: Any, role: NodeRole, protocol: PdProtocol | None, where: str) -> int | None:
    """An sglang prefill node's bootstrap server port: required for one, refused for any other node."""
    sglang_prefill = role is NodeRole.PREFILL and protocol is PdProtocol.SGLANG
    if value is None:
        if sglang_prefill:
            raise NodesConfigError(f"{where}: an sglang prefill node needs bootstrap_port (its engine's "
                                   f"--disaggregation-bootstrap-port)")
        return None
    if not sglang_prefill:
        raise NodesConfigError(f"{where}: bootstrap_port is only for an sglang prefill node "
                               f"(role {role}, pd_protocol {protocol})")
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise NodesConfigError(f"{where}: bootstrap_port must be a port number 1..65535, got {value!r}")
    return value


# -- the file ---------------------------------------------------------------------------------------


def _warnings(tables: Sequence[dict[str, Any]], nodes: Sequence[Node]) -> list[str]:
    notes = []
    by_command: dict[str, list[Node]] = {}
    for node in nodes:
        if node.npu_smi is not None:
            by_command.setdefault(node.npu_smi, []).append(node)
    for node in nodes:
        if node.npu_exporter and node.npu_smi is not None:
            notes.append(f"node {node.id!r}: npu_smi is ignored: npu_exporter {node.npu_exporter!r} is read instead")
    for command, members in by_command.items():
        if len(members) > 1 and any(n.selector.selects_all for n in members):
            names = ", ".join(n.id for n in members)
            notes.append(f"nodes {names} share npu_smi {command!r} but not all name their npu_ids/chips: "
                         "those get every chip")
    return notes


def parse_nodes(document: dict[str, Any], registration: bool = False) -> tuple[list[Node], list[str]]:
    """``(nodes, warnings)`` from a decoded nodes.toml document; ``registration``: every node
    needs a capacity and there must be at least one (``laswrr up --nodes``, ``register --nodes``)."""
    tables = document.get("node", [])
    if not isinstance(tables, list):
        raise NodesConfigError("'node' must be an array of tables: write [[node]], not [node]")
    if registration and not tables:
        raise NodesConfigError("no [[node]] tables (each needs id, url and capacity; pool and chip are optional)")
    nodes = [_node(table, i, registration) for i, table in enumerate(tables)]
    seen: set[str] = set()
    for node in nodes:
        if node.id in seen:
            raise NodesConfigError(f"node {node.id!r} is defined twice")
        seen.add(node.id)
    return nodes, _warnings(tables, nodes)


def load_nodes(path: str | Path, registration: bool = False) -> tuple[list[Node], list[str]]:
    """Read and parse ``path``; NodesConfigError (one line, naming the file) when unreadable or invalid."""
    try:
        document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise NodesConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise NodesConfigError(f"{path} is not valid TOML: {exc}") from None
    try:
        return parse_nodes(document, registration)
    except NodesConfigError as exc:
        raise NodesConfigError(f"{path}: {exc}") from None

