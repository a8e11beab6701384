"""The `laswrr` command line: one entry point, one sub-command per module.

Each module listed in COMMAND_MODULES exposes ``register(subparsers)``, which adds its
sub-command(s) with ``set_defaults(func=handler)``; a handler takes the parsed
arguments and returns the process exit code. Modules are imported only to build
the parser, so adding a command means adding one line here.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMAND_MODULES: tuple[str, ...] = (
    "laswrr.services.analysis",
    "laswrr.services.recorder",
    "laswrr.collectors.cli",
    "laswrr.services.sim_engine.cli",
    "laswrr.services.collector",
    "laswrr.services.scheduler_service",
    "laswrr.services.operator",
    "laswrr.services.up",
    "laswrr.services.proxy.cli",
    "laswrr.bench.cli",
    "laswrr.bench.demo",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="laswrr",
        description="Load-aware smooth weighted round-robin router for LLM inference on Ascend NPU pools.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
