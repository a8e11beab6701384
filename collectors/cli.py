"""Inspection commands for the collector parsers.

``laswrr npu-smi parse FILE`` prints the chips of an ``npu-smi info`` table as JSON;
``laswrr metrics parse FILE [--engine ...]`` prints what the router reads from an engine's
``/metrics`` text. FILE ``-`` reads stdin. Parse failures and unreadable files print one
line to stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from laswrr.collectors.errors import ParseError
from laswrr.collectors.npu_smi import parse_info
from laswrr.collectors.prometheus import EngineMetrics, Histogram, parse_engine_metrics

EXIT_BAD_INPUT = 2
_CHIP_FIELDS = (
    "npu_id",
    "chip_id",
    "name",
    "health",
    "power_w",
    "temp_c",
    "aicore_util",
    "hbm_used_mb",
    "hbm_total_mb",
    "memory_used_mb",
    "memory_total_mb",
)


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    with open(path, "rb") as handle:
        return handle.read().decode("utf-8", errors="replace")


def _fail(command: str, message: str) -> int:
    print(f"laswrr {command}: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _print_json(payload: dict[str, Any]) -> None:
    print(json.dumps(payload, indent=2))


def _npu_smi_parse(args: argparse.Namespace) -> int:
    try:
        chips = parse_info(_read(args.file))
    except OSError as exc:
        return _fail("npu-smi parse", f"cannot read {args.file}: {exc.strerror or exc}")
    except ParseError as exc:
        return _fail("npu-smi parse", f"{args.file}: {exc}")
    _print_json({"chips": [{field: getattr(chip, field) for field in _CHIP_FIELDS} for chip in chips]})
    return 0


def _histogram_json(histogram: Histogram | None) -> dict[str, float | None] | None:
    if histogram is None:
        return None
    return {"sum": histogram.sum, "count": histogram.count}


def metrics_json(metrics: EngineMetrics) -> dict[str, Any]:
    """The JSON object ``laswrr metrics parse`` prints."""
    return {
        "engine": metrics.engine,
        "running": metrics.running,
        "waiting": metrics.waiting,
        "kv_cache_usage": metrics.kv_cache_usage,
        "kv_cache_usage_max": metrics.kv_cache_usage_max,
        "ttft_seconds": _histogram_json(metrics.ttft),
        "e2e_seconds": _histogram_json(metrics.e2e),
        "models": list(metrics.models),
        "truncated": metrics.truncated,
    }


def _metrics_parse(args: argparse.Namespace) -> int:
    try:
        metrics = parse_engine_metrics(_read(args.file), args.engine)
    except OSError as exc:
        return _fail("metrics parse", f"cannot read {args.file}: {exc.strerror or exc}")
    except ParseError as exc:
        return _fail("metrics parse", f"{args.file}: {exc}")
    _print_json(metrics_json(metrics))
    return 0


def register(subparsers: Any) -> None:
    """Add ``npu-smi parse`` and ``metrics parse`` to the ``laswrr`` command line."""
    npu = subparsers.add_parser("npu-smi", help="inspect npu-smi output")
    npu_sub = npu.add_subparsers(dest="npu_smi_command", metavar="ACTION", required=True)
    npu_parse = npu_sub.add_parser("parse", help="parse an `npu-smi info` table, print its chips as JSON")
    npu_parse.add_argument("file", metavar="FILE", help="file with `npu-smi info` output, or - for stdin")
    npu_parse.set_defaults(func=_npu_smi_parse)

    metrics = subparsers.add_parser("metrics", help="inspect engine /metrics text")
    metrics_sub = metrics.add_subparsers(dest="metrics_command", metavar="ACTION", required=True)
    metrics_parse = metrics_sub.add_parser("parse", help="parse a /metrics body, print the engine sample as JSON")
    metrics_parse.add_argument("file", metavar="FILE", help="file with /metrics text, or - for stdin")
    metrics_parse.add_argument(
        "--engine", choices=("vllm", "mindie", "sglang", "auto"), default="auto",
        help="engine whose metric names to read (default: detect)",
    )
    metrics_parse.set_defaults(func=_metrics_parse)
