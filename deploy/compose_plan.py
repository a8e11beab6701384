"""compose.yaml -> a plan of local processes (pure: no process is started, no file is written).

What Docker would do with the file, translated for one machine without a Docker engine:

* **Interpolation** as Compose does it: ``$$`` is a literal ``$``; ``${VAR}``, ``$VAR``,
  ``${VAR:-default}`` (unset or empty), ``${VAR-default}`` (unset), ``${VAR:?message}`` /
  ``${VAR?message}`` (an error), ``${VAR:+alt}`` / ``${VAR+alt}``. Nested expressions inside a
  default are not supported (compose.yaml uses none).
* **Selection**: services without ``profiles`` plus those sharing one with ``--profile``; a
  selected service that depends on an unselected one is an error, as in Compose. A service with
  ``deploy.replicas: N > 1`` becomes N instances ``<service>-1..N``.
* **Network**: every container port a service declares (``expose`` and the container side of
  ``ports``) gets its own free local port. In every string of a service (command, environment,
  health check, mounted text files) ``<service>:<port>`` becomes ``127.0.0.1:<local port>``, and
  the instance's own ``127.0.0.1|localhost|0.0.0.0:<port>`` its own local port; a port option
  of its command (``-p``, ``-m``, ``--*port``) naming one of its container ports is rewritten.
  Published host ports are ignored (tests never bind fixed ports).
* **Files**: a named volume is a directory ``<workdir>/volumes/<name>``; a bind-mounted file is
  copied to ``<workdir>/mounts/<instance>/`` with the network translation applied to its text
  (nodes.toml names engines by service name); container paths in arguments become these local
  paths. The image's own files (``/app/deploy``) map to the build context.
* **Programs**: the laswrr image (``build:`` or an image named ``laswrr*``) runs ``laswrr
  <command>``; the nats image runs ``nats-server <command>``; ``python`` and ``laswrr`` in health
  checks are this interpreter and its ``laswrr``; ``wget``/``curl`` health checks become a GET.
* **Lifecycle**: ``depends_on`` conditions (started, healthy, completed successfully) order the
  start; a service whose restart policy is ``no`` or ``on-failure[:N]`` is a one-shot that must
  exit 0 (retried up to N times, default 3, like ``on-failure``); the others must stay up.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

LOCALHOST = "127.0.0.1"
OWN_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0")
ONESHOT_DEFAULT_RETRIES = 3
_VAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\?|\?|:\+|\+)(?P<arg>.*))?$", re.S)
_HOST_PORT = re.compile(r"(?P<host>[A-Za-z0-9_.-]+):(?P<port>\d{1,5})(?!\d)")
_PORT_FLAG = re.compile(r"^(-p|-m|--[\w-]*port)$")
_PORT_ASSIGN = re.compile(r"^(?P<flag>--[\w-]*port)=(?P<port>\d+)$")


class ComposeError(ValueError):
    """compose.yaml cannot be run locally; the message is one line."""


# -- interpolation ----------------------------------------------------------------------------------


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """``value`` with every string interpolated against ``env`` (mappings and lists recursively)."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: _substitute(m, env), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def _substitute(match: re.Match[str], env: Mapping[str, str]) -> str:
    if match.group("escaped"):
        return "$"
    if match.group("named"):
        return env.get(match.group("named"), "")
    braced = _BRACED.match(match.group("braced"))
    if braced is None:
        raise ComposeError(f"invalid interpolation {match.group(0)!r}")
    name, op, arg = braced.group("name"), braced.group("op"), braced.group("arg") or ""
    value = env.get(name)
    unset_or_empty = not value if (op or "").startswith(":") else value is None
    if op in (":-", "-"):
        return arg if unset_or_empty else str(value)
    if op in (":?", "?"):
        if unset_or_empty:
            raise ComposeError(f"required variable {name} is missing a value: {arg or 'unset'}")
        return str(value)
    if op in (":+", "+"):
        return "" if unset_or_empty else arg
    return value or ""


def load_compose(path: str | Path, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The compose file, YAML merge keys resolved, every string interpolated against ``env``."""
    try:
        document = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ComposeError(f"cannot read {path}: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("services"), dict):
        raise ComposeError(f"{path}: no 'services' mapping")
    return dict(interpolate(document, os.environ if env is None else env))


# -- the shape of one service ------------------------------------------------------------------------


def selected_services(document: Mapping[str, Any], profiles: Iterable[str] = ()) -> list[str]:
    """Service names enabled by ``profiles``, in dependency order (dependencies first)."""
    active = set(profiles)
    services: dict[str, Any] = document["services"]
    chosen = [n for n, s in services.items() if not s.get("profiles") or active & set(s["profiles"])]
    for name in chosen:
        for dependency in depends_on(services[name]):
            if dependency not in chosen:
                raise ComposeError(f"service {name!r} depends on {dependency!r}, which is not enabled")
    ordered: list[str] = []

    def visit(name: str, trail: tuple[str, ...]) -> None:
        if name in trail:
            raise ComposeError(f"dependency cycle: {' -> '.join((*trail, name))}")
        if name not in ordered:
            for dependency in depends_on(services[name]):
                visit(dependency, (*trail, name))
            ordered.append(name)

    for name in chosen:
        visit(name, ())
    return ordered


def depends_on(spec: Mapping[str, Any]) -> dict[str, str]:
    """``{dependency: condition}`` from the list or mapping form."""
    raw = spec.get("depends_on") or {}
    if isinstance(raw, list):
        return {str(name): "service_started" for name in raw}
    return {str(name): str((options or {}).get("condition", "service_started")) for name, options in raw.items()}


def container_ports(spec: Mapping[str, Any]) -> list[int]:
    """Ports the service listens on inside its container: ``expose`` and the target of ``ports``."""
    found: list[int] = []
    for item in spec.get("expose") or []:
        found.append(_port_number(str(item).split("/")[0]))
    for item in spec.get("ports") or []:
        target = item.get("target") if isinstance(item, dict) else str(item).split("/")[0].rsplit(":", 1)[-1]
        found.append(_port_number(str(target)))
    return sorted(set(found))


def _port_number(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ComposeError(f"unsupported port {text!r} (a single port number, please)")
    return int(text)


def replicas(spec: Mapping[str, Any]) -> int:
    count = (spec.get("deploy") or {}).get("replicas", 1)
    if not isinstance(count, int) or count < 1:
        raise ComposeError(f"deploy.replicas must be an integer >= 1, got {count!r}")
    return count


def restart_policy(spec: Mapping[str, Any]) -> tuple[bool, int]:
    """``(one_shot, retries)``: ``no`` and ``on-failure[:N]`` are one-shots, the rest long-running."""
    policy = str(spec.get("restart", "no"))
    if policy == "no":
        return True, 0
    if policy.startswith("on-failure"):
        _, _, count = policy.partition(":")
        return True, int(count) if count.isdigit() else ONESHOT_DEFAULT_RETRIES
    return False, 0


def health_test(spec: Mapping[str, Any]) -> list[str] | None:
    """The health check as ``["CMD", ...]`` or ``["CMD-SHELL", cmd]``; None when absent/disabled."""
    check = spec.get("healthcheck") or {}
    if check.get("disable"):
        return None
    test = check.get("test")
    if test is None or test == ["NONE"]:
        return None
    if isinstance(test, str):
        return ["CMD-SHELL", test]
    if not isinstance(test, list) or not test or test[0] not in ("CMD", "CMD-SHELL"):
        raise ComposeError(f"unsupported healthcheck test {test!r}")
    return [str(t) for t in test]


def environment(spec: Mapping[str, Any]) -> dict[str, str]:
    raw = spec.get("environment") or {}
    if isinstance(raw, list):
        pairs = (str(item).partition("=") for item in raw)
        return {k: v for k, _, v in pairs}
    return {str(k): "" if v is None else str(v) for k, v in raw.items()}


# -- the local plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Runtime:
    """How this machine runs the images' programs."""

    build_context: Path
    laswrr: tuple[str, ...]
    python: str
    nats_server: str


@dataclass(frozen=True)
class Health:
    """A health check: a GET on ``url``, or ``argv`` exiting 0 (``shell`` for CMD-SHELL)."""

    url: str | None = None
    argv: tuple[str, ...] = ()
    shell: bool = False


@dataclass
class ProcessPlan:
    name: str
    service: str
    argv: list[str]
    env: dict[str, str]
    ports: dict[int, int]
    depends: dict[str, str]
    health: Health | None
    one_shot: bool
    retries: int
    stop_grace_s: float
    files: dict[Path, str] = field(default_factory=dict)   # local path -> translated text to write
    dirs: list[Path] = field(default_factory=list)         # named-volume directories to create


@dataclass(frozen=True)
class Network:
    """(service, container port) -> local port, for everyone; plus the instance's own ports."""

    shared: Mapping[tuple[str, int], int]
    own: Mapping[int, int]

    def local_port(self, host: str, port: int) -> int | None:
        if host in OWN_HOSTS and port in self.own:
            return self.own[port]
        return self.shared.get((host, port))

    def text(self, value: str) -> str:
        def swap(match: re.Match[str]) -> str:
            local = self.local_port(match.group("host"), int(match.group("port")))
            return match.group(0) if local is None else f"{LOCALHOST}:{local}"
        return _HOST_PORT.sub(swap, value)

    def argv(self, argv: Sequence[str]) -> list[str]:
        out: list[str] = []
        for i, token in enumerate(argv):
            assign = _PORT_ASSIGN.match(token)
            if i > 0 and _PORT_FLAG.match(argv[i - 1]) and token.isdigit() and int(token) in self.own:
                token = str(self.own[int(token)])
            elif assign and int(assign.group("port")) in self.own:
                token = f"{assign.group('flag')}={self.own[int(assign.group('port'))]}"
            out.append(self.text(token))
        return out


def _translate_path(token: str, paths: Mapping[str, str]) -> str:
    prefix, sep, value = token.partition("=") if token.startswith("-") and "=" in token else ("", "", token)
    for target in sorted(paths, key=len, reverse=True):
        if value == target or value.startswith(target.rstrip("/") + "/"):
            return f"{prefix}{sep}{paths[target]}{value[len(target):]}"
    return token


def _program(spec: Mapping[str, Any]) -> str:
    image = str(spec.get("image", ""))
    if "build" in spec or image.rsplit("/", 1)[-1].startswith("laswrr"):
        return "laswrr"
    if image.rsplit("/", 1)[-1].startswith("nats"):
        return "nats-server"
    raise ComposeError(f"image {image!r} has no local equivalent (laswrr or nats)")


def _volumes(instance: str, spec: Mapping[str, Any], compose_dir: Path, workdir: Path,
             network: Network) -> tuple[dict[str, str], dict[Path, str], list[Path]]:
    paths: dict[str, str] = {}
    files: dict[Path, str] = {}
    dirs: list[Path] = []
    for item in spec.get("volumes") or []:
        if isinstance(item, dict):
            source, target = str(item.get("source", "")), str(item["target"])
        else:
            source, _, rest = str(item).partition(":")
            target = rest.split(":")[0]
        if not source or not source.startswith((".", "/", "~")):
            local = workdir / "volumes" / (source or f"{instance}-anonymous")
            dirs.append(local)
        else:
            origin = (compose_dir / Path(source).expanduser()).resolve()
            if origin.is_dir():
                local = origin
            else:
                try:
                    text = origin.read_text(encoding="utf-8")
                except OSError as exc:
                    raise ComposeError(f"service {instance!r}: cannot read bind mount {source}: {exc}") from None
                local = workdir / "mounts" / instance / origin.name
                files[local] = network.text(text)
        paths[target] = str(local)
    return paths, files, dirs


def _health(spec: Mapping[str, Any], network: Network, paths: Mapping[str, str],
            runtime: Runtime) -> Health | None:
    test = health_test(spec)
    if test is None:
        return None
    if test[0] == "CMD-SHELL":
        return Health(argv=(network.text(test[1]),), shell=True)
    argv = [_translate_path(t, paths) for t in network.argv(test[1:])]
    if argv and argv[0] in ("wget", "curl"):
        urls = [t for t in argv if t.startswith(("http://", "https://"))]
        if not urls:
            raise ComposeError(f"health check {test!r} names no URL")
        return Health(url=urls[0])
    programs = {"python": [runtime.python], "python3": [runtime.python], "laswrr": list(runtime.laswrr)}
    return Health(argv=tuple(programs.get(argv[0], [argv[0]]) + argv[1:]))


def _grace_s(spec: Mapping[str, Any]) -> float:
    raw = str(spec.get("stop_grace_period", "10s"))
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)?", raw)
    if match is None:
        raise ComposeError(f"unsupported stop_grace_period {raw!r}")
    return float(match.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0}[match.group(2) or "s"]


def plan(document: Mapping[str, Any], compose_dir: Path, workdir: Path, runtime: Runtime,
         profiles: Iterable[str] = (), allocate_port: Callable[[], int] | None = None) -> list[ProcessPlan]:
    """One ProcessPlan per instance of each selected service, dependencies first."""
    services: dict[str, Any] = document["services"]
    names = selected_services(document, profiles)
    instances = {n: [n] if replicas(services[n]) == 1 else [f"{n}-{i}" for i in range(1, replicas(services[n]) + 1)]
                 for n in names}
    allocate = allocate_port or _port_counter(20000)
    own = {inst: {p: allocate() for p in container_ports(services[n])} for n in names for inst in instances[n]}
    shared = {(n, p): own[instances[n][0]][p] for n in names for p in container_ports(services[n])}
    shared.update({(inst, p): port for inst, ports in own.items() for p, port in ports.items()})
    plans = []
    for name in names:
        spec = services[name]
        for instance in instances[name]:
            plans.append(_instance_plan(name, instance, spec, Network(shared, own[instance]), compose_dir,
                                        workdir, runtime, instances))
    return plans


def _instance_plan(name: str, instance: str, spec: Mapping[str, Any], network: Network, compose_dir: Path,
                   workdir: Path, runtime: Runtime, instances: Mapping[str, list[str]]) -> ProcessPlan:
    paths, files, dirs = _volumes(instance, spec, compose_dir, workdir, network)
    program = _program(spec)
    if program == "laswrr":
        paths = {"/app/deploy": str(runtime.build_context / "deploy"), **paths}
        entry = list(runtime.laswrr)
    else:
        entry = [runtime.nats_server]
    command = spec.get("command") or []
    if isinstance(command, str):
        command = command.split()
    argv = entry + [_translate_path(t, paths) for t in network.argv([str(c) for c in command])]
    env = {k: _translate_path(network.text(v), paths) for k, v in environment(spec).items()}
    one_shot, retries = restart_policy(spec)
    depends = {inst: condition for dep, condition in depends_on(spec).items() for inst in instances[dep]}
    return ProcessPlan(name=instance, service=name, argv=argv, env=env, ports=dict(network.own), depends=depends,
                       health=_health(spec, network, paths, runtime), one_shot=one_shot, retries=retries,
                       stop_grace_s=_grace_s(spec), files=files, dirs=dirs)


def _port_counter(start: int) -> Callable[[], int]:
    ports = iter(range(start, 65536))
    return lambda: next(ports)
