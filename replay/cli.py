"""``laswrr replay``: re-run a recorded log through the pure core.

``--events FILE.jsonl`` reads the portable form and prints every output as a JSON line of the
same form (byte-identical for identical input). Malformed lines are reported on stderr with
their line number and become rejections in the output.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from replay.portable import LineError, replay_lines
from scheduler import config as config_mod


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("replay", help="replay a recorded event log through the scheduler core",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", metavar="FILE.jsonl", help="portable log: one {seq, ts_ns, subject, data} per line ('-' = stdin)")
    parser.add_argument("--config", metavar="FILE.toml", help="initial scheduler configuration (default: built-in)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.events:
        print("laswrr replay: give --events FILE.jsonl", file=sys.stderr)
        return 2
    config = config_mod.load_file(args.config) if args.config else None
    try:
        source = sys.stdin.buffer if args.events == "-" else open(args.events, "rb")
    except OSError as exc:
        print(f"laswrr replay: cannot read {args.events}: {exc.strerror}", file=sys.stderr)
        return 2
    errors: list[LineError] = []
    out = sys.stdout.buffer
    with source:
        for line in replay_lines(source, config, errors):
            out.write(line)
    out.flush()
    for error in errors:
        print(f"laswrr replay: {args.events}: {error.reason}", file=sys.stderr)
    return 0
