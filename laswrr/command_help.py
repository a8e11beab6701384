"""What ``laswrr <command> --help`` says above and below the flags: one paragraph, then examples.

One literal table, ``HELP``: command -> (paragraph, examples). ``laswrr.cli.build_parser`` puts
the paragraph in each sub-parser's description and the examples in its epilog, in place of the
module docstrings (those are for the people who work on the code). A test checks that every
command has an entry, that each paragraph is one paragraph and that each example parses.
"""

from __future__ import annotations

import argparse
import textwrap

HELP: dict[str, tuple[str, tuple[str, ...]]] = {
    "up": (
        "Run the whole stack in one process tree: an embedded nats-server (unless --nats-url is given), "
        "the scheduler, the recorder, the collector, the proxy, and four simulated engines unless --nodes "
        "names your engines; registers the nodes, prints the NATS and proxy URLs and the operator commands. "
        "Ctrl-C or SIGTERM stops everything in order; data and logs go under --data-dir.",
        ("laswrr up", "laswrr up --nodes nodes.toml --proxy-port 9000",
         "laswrr up --nats-url nats://10.0.0.2:4222 --proxy-host 0.0.0.0"),
    ),
    "proxy": (
        "Run one OpenAI-compatible proxy replica: every OpenAI POST route is routed by the body's model "
        "to a node of its pool (LA-SWRR by default), on the snapshots in KV LB_WEIGHTS (which count the "
        "other replicas' requests in flight) and its own in-flight counts; /health, /readiness and "
        "/metrics beside. The first stdout line is 'proxy listening on URL'; SIGTERM lets in-flight "
        "requests finish (--grace-s) before it exits. --workers N: N such processes on one port.",
        ("laswrr proxy --port 8000 --proxy-id proxy-a",
         "laswrr proxy --policy round_robin --log-level warning --log-format json",
         "laswrr proxy --port 8000 --reuse-port --grace-s 10s",
         "laswrr proxy --port 8000 --proxy-id edge --workers 4 --admin-port 9200"),
    ),
    "scheduler": (
        "Run a scheduler replica: applies every event of LB_EVENTS, in order, to the pure LA-SWRR core and "
        "publishes its snapshots, phase changes and rejections (LB_OUT, KV LB_WEIGHTS); ticks every "
        "--tick-ms. Replicas are active-active: give each a distinct --replica-id.",
        ("laswrr scheduler", "laswrr scheduler --replica-id b --tick-ms 100ms --metrics-port 9101"),
    ),
    "recorder": (
        "Record every message of LB_EVENTS and LB_OUT exactly once into DIR/events.duckdb, acknowledging "
        "after each commit. Run one recorder per file; analysts read it with report, replay and export.",
        ("laswrr recorder --data-dir /var/lib/laswrr", "laswrr recorder --flush-ms 500ms --metrics-port 9102"),
    ),
    "collector": (
        "Poll the engines of a nodes file (their /metrics and health) and run their npu-smi, and publish "
        "each sample into the event log for the scheduler; follows nodes registered or removed at runtime.",
        ("laswrr collector --nodes nodes.toml", "laswrr collector --nodes nodes.toml --interval-ms 1s --metrics-port 9100"),
    ),
    "kv-events": (
        "Subscribe to the KV cache events of every node registered with kv_events (vLLM's "
        "--kv-events-config publisher, over ZMQ), and publish each node's cache changes on lb.kv.<node> "
        "(core NATS, not recorded); a missed batch is fetched from the node's kv_events_replay endpoint, "
        "else the node's index is dropped; follows nodes registered or removed at runtime.",
        ("laswrr kv-events", "laswrr kv-events --nats-url nats://10.0.0.2:4222 --metrics-port 9101"),
    ),
    "sim-engine": (
        "Run a simulated Ascend inference engine: an OpenAI-compatible HTTP server (chat, completions, "
        "responses, embeddings) with continuous-batching physics of the chosen chip, vLLM-style /metrics, "
        "/health, a simulated npu-smi and an /admin endpoint for faults. The first stdout line is "
        "'sim-engine listening on URL'.",
        ("laswrr sim-engine --port 8001 --chip 910C --capacity 16 --model sim-llm",
         "laswrr sim-engine --port 0 --speed 20"),
    ),
    "sim-npu-smi": (
        "Print `npu-smi info` as the simulated engine at --url shows it (what a collector's npu_smi "
        "command can run for a simulated node).",
        ("laswrr sim-npu-smi --url http://127.0.0.1:8001",),
    ),
    "capacity": (
        "Set a node's current capacity (concurrent requests; 0 drains it): publishes "
        "lb.admin.capacity.NODE and prints whether the scheduler applied it (exit 0), rejected it "
        "(exit 1, with the reason) or did not answer within --wait (exit 3).",
        ("laswrr capacity sim-910b-1 1", "laswrr capacity n1 0 --wait 5s"),
    ),
    "drain": (
        "Admit no new requests to a node; the ones in flight finish. Prints the scheduler's verdict.",
        ("laswrr drain sim-910b-1",),
    ),
    "undrain": (
        "Bring a drained or draining node back, with slow start. Prints the scheduler's verdict.",
        ("laswrr undrain sim-910b-1",),
    ),
    "remove": (
        "Drain a node, then forget it. Prints the scheduler's verdict.",
        ("laswrr remove sim-910b-1",),
    ),
    "register": (
        "Register or update a node (lb.admin.node.NODE): its OpenAI base URL, pool, chip and capacity, and "
        "optionally how the collector reads it; or every [[node]] of a nodes file. Prints the verdicts.",
        ("laswrr register n5 --url http://10.0.0.5:8000 --chip 910B --capacity 10",
         "laswrr register --nodes nodes.toml"),
    ),
    "query": (
        "Run one SQL statement on the recorded log (the events table and the views of docs/analysts.md) and "
        "print the rows as CSV with a header (--json: one JSON object per line). A running recorder's file is "
        "read through a consistent copy, as for report; the viewer's credentials suffice.",
        ("laswrr query --db .laswrr/events.duckdb \"SELECT outcome, count(*) FROM requests GROUP BY ALL\"",
         "laswrr query --db parquet-out/ --json \"SELECT * FROM requests LIMIT 5\""),
    ),
    "config": (
        "Change scheduler configuration keys at runtime (lb.admin.config, so a replay applies them too) and "
        "print the scheduler's verdict: applied (exit 0, with the keys now in force) or rejected (exit 1, with "
        "the reason: an unknown key or a bad value). Every key, with its default and unit, is in "
        "docs/configuration.md (\"Scheduler keys at runtime\", generated from scheduler/config.py).",
        ("laswrr config max_capacity=8192", "laswrr config slow_start_window_ms=10000 ease_max_step=0.5"),
    ),
    "nodes": (
        "Show each pool's latest snapshot as a table: phase, capacity, target and effective weight, "
        "in-flight, load and sample age of every node (--json for tools).",
        ("laswrr nodes", "laswrr nodes --pool default --json"),
    ),
    "report": (
        "The zero-interruption verdict of a recorded log: requests by outcome, interruptions, admissions "
        "to draining nodes and drain times.",
        ("laswrr report --db .laswrr/events.duckdb", "laswrr report --db .laswrr/events.duckdb --json"),
    ),
    "replay": (
        "Re-run a recorded log (DuckDB or the portable JSONL form) through the scheduler core: every "
        "snapshot must match byte for byte, else the first divergent sequence is named. --what-if re-runs "
        "it with other settings and compares. --latency refolds the proxies' latency estimates instead: every "
        "prediction they recorded must be made again exactly, and the estimate's error per node is reported.",
        ("laswrr replay --db .laswrr/events.duckdb",
         "laswrr replay --events docs/examples/capacity-drop.jsonl",
         "laswrr replay --db .laswrr/events.duckdb --what-if ease_max_step=0.5 --out whatif/",
         "laswrr replay --db .laswrr/events.duckdb --latency"),
    ),
    "history": (
        "What happened to one node, in order, from a recorded log: its admin commands (applied, or rejected "
        "with the reason), phase changes, capacity changes, ejections and their causes, and rejected samples or "
        "probes naming it; --at TIME keeps the --window-s before and after it.",
        ("laswrr history sim-910b-2 --db .laswrr/events.duckdb",
         "laswrr history sim-910b-2 --db .laswrr/events.duckdb --at +5 --window-s 30"),
    ),
    "export": (
        "Write a recorded log as Parquet (DIR/events.parquet and one file per analyst view), readable by "
        "any tool at any time.",
        ("laswrr export --db .laswrr/events.duckdb --parquet archive/",),
    ),
    "npu-smi": (
        "Check what the collector reads from an `npu-smi info` table: `parse FILE` prints its chips as JSON.",
        ("npu-smi info | laswrr npu-smi parse -",),
    ),
    "metrics": (
        "Check what the collector reads from an engine's /metrics text: `parse FILE` prints the sample as JSON.",
        ("curl -s http://127.0.0.1:8001/metrics | laswrr metrics parse -",),
    ),
    "dashboard": (
        "Serve one read-only web page per deployment: every pool's nodes with their weights, phases, "
        "in-flight and request outcomes, live from NATS, or over a recorded log with a time scrubber "
        "(--db). It publishes nothing.",
        ("laswrr dashboard", "laswrr dashboard --port 8090 --keep-s 30m",
         "laswrr dashboard --db .laswrr/events.duckdb"),
    ),
    "bench": (
        "Run a scenario for several policies on the identical workload against the real stack (or replay "
        "a trace), and write a table, results.json and plots under --out. With --virtual (trace scenarios, "
        "in virtual time) it prints the table and writes virtual.json only: no plots, no recorded runs.",
        ("laswrr bench --scenario announced-drop --policies la-swrr,rr,least-request,p2c",
         "laswrr bench --list", "laswrr bench --trace trace.jsonl --policies la-swrr,round_robin --no-plots",
         "laswrr bench --scenario heterogeneous --policies la-swrr --proxies 4"),
    ),
    "demo": (
        "The showcase (what `make demo` runs): the announced capacity drop, LA-SWRR against round robin "
        "on the real stack with simulated engines; prints the verdicts and writes plots and results.",
        ("laswrr demo --out demo-out",),
    ),
}


# What a flag without a value means, where "(default: none)" would not say it.
DEFAULT_TEXT: dict[tuple[str, str], str] = {
    ("nodes", "--pool"): "every pool",
    ("register", "--chip"): "unknown",
    ("register", "--capacity"): "none: required without --nodes",
    ("register", "--url"): "none: required without --nodes",
    ("up", "--config"): "the built-in keys, scheduler/config.py",
    ("up", "--allow-upstream"): "the nodes' own hosts only",
    ("scheduler", "--config"): "the keys in force in the log",
    ("replay", "--config"): "the built-in keys",
    ("replay", "--what-if"): "none",
    ("dashboard", "--db"): "live from NATS",
    ("bench", "--scheduler-config"): "the scenario's",
    ("bench", "--trace"): "the scenario's own workload",
    ("sim-engine", "--port"): "the configuration's, 8001",
    ("collector", "--metrics-port"): "not served",
    ("proxy", "--extra-routes"): "none",
    ("proxy", "--upstream-api-key"): "none, or $LASWRR_UPSTREAM_API_KEY",
}


def note_defaults(name: str, parser: argparse.ArgumentParser) -> None:
    """Every flag's help says its default: ``%(default)s`` where the value says it, ``off`` for
    a switch, ``required`` for a required flag, else ``DEFAULT_TEXT`` or ``none``
    (tests/test_command_help.py checks every flag of every command)."""
    for action in parser._actions:
        if not action.option_strings or action.help in (None, argparse.SUPPRESS) or isinstance(
                action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        if "default" in action.help.lower() or "required" in action.help.lower():
            continue
        flag = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
        if action.required:
            note = "required"
        elif (name, flag) in DEFAULT_TEXT:
            note = f"default: {DEFAULT_TEXT[(name, flag)]}"
        elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreConstAction)) or action.nargs == 0:
            note = "default: off"
        elif action.default is None or action.default == [] or action.default == ():
            note = "default: none"
        else:
            note = "default: %(default)s"
        action.help = f"{action.help} ({note})"


def apply(commands: dict[str, argparse.ArgumentParser]) -> None:
    """Set each command's description and examples from ``HELP`` (commands without an entry keep
    theirs), and have every flag's help say its default (``note_defaults``)."""
    for name, parser in commands.items():
        note_defaults(name, parser)
        if name not in HELP:
            continue
        paragraph, examples = HELP[name]
        parser.description = paragraph
        parser.epilog = "examples:\n" + "\n".join(f"  {example}" for example in examples)
        parser.formatter_class = _Formatter


class _Formatter(argparse.HelpFormatter):
    """The paragraph wrapped to the terminal; the examples kept line by line."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:\n"):
            return "".join(indent + line + "\n" for line in text.splitlines()).rstrip("\n")
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent)
