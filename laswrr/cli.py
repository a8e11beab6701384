"""The `laswrr` command line: one entry point, one sub-command per module.

Each module listed in COMMAND_MODULES exposes ``register(subparsers)``, which adds its
sub-command(s) with ``set_defaults(func=handler)``; a handler takes the parsed
arguments and returns the process exit code. Modules are imported only to build
the parser, so adding a command means adding one line here.

Help: ``laswrr <command> --help`` shows one paragraph and examples from ``laswrr.command_help``
(not the module docstrings). Settings from the environment: every ``--flag`` of a command may also be given as the variable
``LASWRR_<FLAG>`` (upper case, ``-`` as ``_``: ``LASWRR_LOG_LEVEL=warning``,
``LASWRR_PROXY_PORT=9000``); a switch (``--reuse-port``) is on for ``1``/``true``/``yes``/``on``
(and a switch with a ``--no-`` form, ``--flow-control``, off for ``0``/``false``/``no``/``off``).
The command line wins over the environment. ``main`` reads them for the command being run
(``environment_args``) and parses them as if typed, so a bad value is the same usage error as
on the command line, naming the variable. docs/configuration.md lists them all, per command
(generated from these parsers by ``python -m laswrr.docgen``, checked by a test).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Mapping, Sequence

from laswrr import __version__, command_help

COMMAND_MODULES: tuple[str, ...] = (
    "laswrr.services.analysis",
    "laswrr.services.recorder",
    "laswrr.collectors.cli",
    "laswrr.services.sim_engine.cli",
    "laswrr.services.collector",
    "laswrr.services.kv_events",
    "laswrr.services.scheduler_service",
    "laswrr.services.operator",
    "laswrr.services.up",
    "laswrr.services.dashboard.app",
    "laswrr.services.proxy.cli",
    "laswrr.bench.cli",
    "laswrr.bench.demo",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="laswrr",
        description="Load-aware smooth weighted round-robin router for LLM inference on Ascend NPU pools.",
        epilog="`laswrr COMMAND --help` says what a command does, with examples; every flag may also be "
               "set as LASWRR_<FLAG> (docs/configuration.md).",
    )
    parser.add_argument("--version", action="version", version=f"laswrr {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    command_help.apply(commands(parser))
    return parser


# -- settings from the environment ----------------------------------------------------------------

ENV_PREFIX = "LASWRR_"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}
_NOT_SETTINGS = {"--help", "--version"}


def env_name(flag: str) -> str:
    """``--log-level`` -> ``LASWRR_LOG_LEVEL``."""
    return ENV_PREFIX + flag.removeprefix("--").upper().replace("-", "_")


def _long_flag(action: argparse.Action) -> str | None:
    return next((o for o in action.option_strings if o.startswith("--") and o not in _NOT_SETTINGS), None)


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def environment_args(command: argparse.ArgumentParser, given: Sequence[str],
                     environ: Mapping[str, str]) -> list[str]:
    """``--flag=value`` for each ``LASWRR_<FLAG>`` set for a flag of ``command`` not in ``given``."""
    out = []
    for action in command._actions:
        flag = _long_flag(action)
        value = environ.get(env_name(flag)) if flag else None
        if flag is None or value is None:
            continue
        if any(arg == opt or arg.startswith(opt + "=") for arg in given for opt in action.option_strings):
            continue  # the command line wins
        negative = next((o for o in action.option_strings if o.startswith("--no-") and o != flag), None)
        if action.nargs != 0:
            out.append(f"{flag}={value}")
        elif value.strip().lower() in _TRUE:
            out.append(flag)
        elif value.strip().lower() in _FALSE:
            out += [negative] if negative else []  # --flow-control/--no-flow-control: off even where on is the default
        else:
            command.error(f"{env_name(flag)}={value!r}: a switch takes 1/0, true/false, yes/no or on/off")
    return out


def with_environment(parser: argparse.ArgumentParser, argv: Sequence[str],
                     environ: Mapping[str, str] = os.environ) -> list[str]:
    """``argv`` with the command's ``LASWRR_*`` settings inserted after the command name."""
    argv = list(argv)
    at = next((i for i, arg in enumerate(argv) if not arg.startswith("-")), None)
    if at is None or argv[at] not in commands(parser):
        return argv
    return argv[:at + 1] + environment_args(commands(parser)[argv[at]], argv[at + 1:], environ) + argv[at + 1:]


def main(argv: Sequence[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    if given == ["--version"]:  # without building the parser, which imports every command's module
        print(f"laswrr {__version__}")
        return 0
    parser = build_parser()
    full = with_environment(parser, given)
    try:
        args = parser.parse_args(full)
    except SystemExit as exc:
        if exc.code not in (0, None) and len(full) > len(given):
            names = sorted({env_name(a.split("=", 1)[0]) for a in full if a not in given and a.startswith("--")})
            print(f"laswrr: settings from the environment: {', '.join(names)}", file=sys.stderr)
        raise
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
