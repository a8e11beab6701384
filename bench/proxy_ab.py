"""The proxy's cost per request, this checkout against another revision (A/B).

    python -m laswrr.bench.proxy_ab --vs REV [--rounds 3] [--requests 4000] [--callgrind-requests 1000]
    python -m laswrr.bench.proxy_ab measure [--requests N] [--connections 4] [--callgrind] [--hold]
    python -m laswrr.bench.proxy_ab load --url URL [--requests N] [--connections 4]

``measure`` starts, through ``laswrr up``'s ``Stack``, the stack ``bench/proxy_bench.py`` starts
(two instant engines, NATS, scheduler, recorder) and one ``laswrr proxy`` (one worker, policy
la-swrr, the channel between proxies off: ``LASWRR_PEER_INTERVAL_MS=0``), sends a warm-up, then
``--requests`` non-streamed chat requests on ``--connections`` keep-alive connections (a
fixed count, not a duration), the scheduler and the recorder stopped (SIGSTOP) meanwhile, and
prints one JSON line. (With the scheduler running, the snapshots it publishes every tick cost the
proxy the same each second whatever its rate: under callgrind, where 1,000 requests take minutes,
they would outweigh the requests. Stopped, the proxy routes on its last snapshot and still
publishes every request's events to JetStream, as the ``laswrr-w1-proxy-only`` target of
``bench/proxy_bench.py`` does.)

* ``cpu_us_per_request``: the proxy process's utime+stime (Linux /proc) over those requests,
  divided by their count. The scheduler, recorder and engines are not in it.
* with ``--callgrind``: the proxy runs under ``valgrind --tool=callgrind --dump-instr=no``;
  its counters are zeroed (``callgrind_control -z``) after the warm-up and dumped
  (``callgrind_control -d``) after the requests, then zeroed again for ``--idle-s`` seconds
  of idle and dumped: ``instructions_per_request`` is the requests' total less the idle rate
  times their wall time, over the count (``instructions_per_request_raw``: without that
  subtraction). Under valgrind the requests' rate follows the machine's load, and the proxy's
  background (timers, heartbeats, NATS pings) costs per second, not per request: subtracted,
  the count does not depend on what else runs on the machine, so it is the figure to compare
  on a busy one. The first dump is kept (``callgrind_out``) for ``callgrind_annotate``.
* with ``--cprofile FILE``: the proxy runs under ``python -m cProfile``, its stats written to
  FILE when it exits (start-up included): the call counts of two revisions say what a request
  calls more often (``pstats``).
* with ``--hold``: the stack stays up after the figures (the proxy's URL in the JSON line)
  until stdin closes, for timing a ``load`` run against two stacks side by side.

``load`` is the fixed-count load generator alone (asyncio, one process): its wall time for
``--requests`` is what a timing tool compares between two held stacks.

``--vs REV`` runs ``measure`` with this checkout's interpreter (B) and with a git worktree of REV
(A: ``/tmp/laswrr-ab-<rev>``, created with its own ``make venv`` when missing) in turns
(A B A B ...), ``--rounds`` times each, without and then with callgrind, and prints each side's
medians and the ratios B/A. The probe is this file, run by each side's interpreter: it uses only
what both revisions have (``Stack``, the bench engine of ``bench/proxy_bench.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

CHAT = {"model": "bench-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
WARMUP = 200
PAUSED = ("scheduler", "recorder")  # stopped (SIGSTOP) while the proxy is measured


# -- the fixed-count load generator ---------------------------------------------------------------

async def _connection(host: str, port: int, request: bytes, count: int) -> int:
    reader, writer = await asyncio.open_connection(host, port)
    errors = 0
    try:
        for _ in range(count):
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            errors += int(head.split(b" ", 2)[1]) >= 400
            lower = head.lower()
            index = lower.find(b"content-length:")
            await reader.readexactly(int(lower[index + 15:lower.index(b"\r\n", index)]))
    finally:
        writer.close()
    return errors


async def fixed_load(url: str, requests: int, connections: int) -> dict[str, Any]:
    """``requests`` non-streamed chat requests on ``connections`` keep-alive connections."""
    hostport = url.split("://", 1)[1].split("/", 1)[0]
    host, _, port = hostport.partition(":")
    body = json.dumps(CHAT).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    shares = [requests // connections + (k < requests % connections) for k in range(connections)]
    started = time.perf_counter()
    errors = await asyncio.gather(*(_connection(host, int(port), request, n) for n in shares))
    return {"requests": requests, "errors": sum(errors), "seconds": time.perf_counter() - started}


# -- the probe --------------------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def http_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


async def wait_routing(admin: str, nodes: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            health = await asyncio.to_thread(http_json, admin + "/healthz")
            if len(health["pools"]["default"]["routable"]) == nodes:
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        await asyncio.sleep(0.3)
    raise TimeoutError("the proxy does not route on both engines")


def callgrind_total(path: Path) -> int:
    """The ``totals:`` (or ``summary:``) line of a callgrind dump: instructions executed."""
    for line in path.read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise ValueError(f"no totals in {path}")


def dump_total(pid: int, workdir: Path) -> int:
    """Instructions since the last zeroing: a dump of the callgrind run (``callgrind_control -d``), read."""
    before = set(workdir.glob("callgrind.out.*"))
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    new = sorted(set(workdir.glob("callgrind.out.*")) - before, key=lambda p: p.stat().st_mtime)
    return callgrind_total(new[-1])


async def probe(args: argparse.Namespace) -> dict[str, Any]:
    from laswrr.collectors.nodes import Node
    from laswrr.services import children
    from laswrr.services.nats_server import free_ports
    from laswrr.services.up import Stack

    os.environ["LASWRR_PEER_INTERVAL_MS"] = "0"  # the channel between proxies off
    workdir = Path(tempfile.mkdtemp(prefix="proxy-ab-"))
    stack = Stack(workdir / "data", proxy_port=0, secure=False)
    result: dict[str, Any] = {"python": sys.executable, "requests": args.requests, "connections": args.connections}
    try:
        engines = await asyncio.gather(*(stack.spawn(f"engine-{i}", "engine", role="sim-engine", wait_listening=True,
                                                     program=(sys.executable, "-m", "laswrr.bench.proxy_bench"))
                                         for i in (1, 2)))
        nodes = [Node(id=f"e{i}", url=child.url or "", capacity=64) for i, child in zip((1, 2), engines)]
        stack.allow_hosts(nodes)
        await stack.start_nats()
        await stack.start_core()
        await stack.register(nodes, wait_s=300.0)  # a busy machine starts slowly
        admin_port = free_ports(1)
        program: tuple[str, ...] = (sys.executable, "-m", "laswrr")
        out = workdir / "callgrind.out"
        if args.callgrind:
            children.START_TIMEOUT_S = 600.0  # Python starts some 50 times slower under valgrind
            program = ("valgrind", "--tool=callgrind", "--dump-instr=no", f"--callgrind-out-file={out}", *program)
        elif args.cprofile:
            program = (sys.executable, "-m", "cProfile", "-o", str(Path(args.cprofile).resolve()), "-m", "laswrr")
        proxy = await stack.spawn("proxy", "proxy", "--host", "127.0.0.1", "--port", "0", "--proxy-id", "proxy",
                                  "--admin-port", str(admin_port), "--policy", "la-swrr", role="proxy",
                                  wait_listening=True, program=program)
        assert proxy.url is not None
        await wait_routing(f"http://127.0.0.1:{admin_port}", len(nodes))
        await fixed_load(proxy.url, WARMUP, args.connections)
        paused = [child.process for child in stack.children if child.name in PAUSED]
        for process in paused:  # no snapshot reaches the proxy while it is measured (module docstring)
            process.send_signal(signal.SIGSTOP)
        pid = proxy.pid
        if args.callgrind:
            subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
        before = cpu_seconds(pid)
        load = await fixed_load(proxy.url, args.requests, args.connections)
        cpu = cpu_seconds(pid) - before
        result.update(errors=load["errors"], seconds=round(load["seconds"], 3),
                      cpu_us_per_request=round(1e6 * cpu / args.requests, 1), url=proxy.url)
        if args.callgrind:
            loaded = dump_total(pid, workdir)
            subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
            started = time.perf_counter()
            await asyncio.sleep(args.idle_s)  # the background alone: timers, heartbeats, NATS pings
            idle_per_s = dump_total(pid, workdir) / (time.perf_counter() - started)
            result.update(instructions_per_request=round((loaded - idle_per_s * load["seconds"]) / args.requests),
                          instructions_per_request_raw=round(loaded / args.requests),
                          idle_instructions_per_s=round(idle_per_s),
                          callgrind_out=str(sorted(workdir.glob("callgrind.out.*"))[0]))
        for process in paused:
            process.send_signal(signal.SIGCONT)
        if args.hold:
            print(json.dumps(result), flush=True)
            await asyncio.to_thread(sys.stdin.read)
    finally:
        for child in stack.children:
            if child.name in PAUSED and child.process.returncode is None:
                child.process.send_signal(signal.SIGCONT)
        await stack.stop()
    return result


# -- A/B ------------------------------------------------------------------------------------------

def worktree(rev: str) -> Path:
    """A detached git worktree of ``rev`` under /tmp with its own ``make venv``."""
    repo = Path(__file__).resolve().parent.parent
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"laswrr-ab-{sha}"
    if not path.exists():
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(path), sha], check=True)
    subprocess.run(["make", "-C", str(path), "venv"], check=True, capture_output=True)
    return path


def run_probe(python: str, requests: int, connections: int, callgrind: bool) -> dict[str, Any]:
    command = [python, str(Path(__file__).resolve()), "measure", "--requests", str(requests),
               "--connections", str(connections), *(["--callgrind"] if callgrind else [])]
    for attempt in (1, 2):  # a probe that fails (a stack that did not come up) is run once more
        # run in the side's own checkout: ``python -m laswrr`` children import from the working directory
        done = subprocess.run(command, capture_output=True, text=True, cwd=Path(python).parents[2])
        if done.returncode == 0:
            return json.loads(done.stdout.strip().splitlines()[-1])
        print(f"  probe failed (exit {done.returncode}, attempt {attempt}): {done.stderr.strip()[-2000:]}",
              file=sys.stderr, flush=True)
    raise SystemExit(f"proxy_ab: the probe {' '.join(command)} failed twice")


def ab(args: argparse.Namespace) -> int:
    sides = {"A": str(worktree(args.vs) / ".venv" / "bin" / "python"), "B": sys.executable}
    print(f"A: {args.vs} ({sides['A']})\nB: this checkout ({sides['B']})", flush=True)
    figures: dict[str, dict[str, list[float]]] = {side: {"cpu": [], "instr": []} for side in sides}
    for callgrind, requests in ((False, args.requests), (True, args.callgrind_requests)):
        for round_no in range(args.rounds if not callgrind else args.callgrind_rounds):
            for side, python in sides.items():
                found = run_probe(python, requests, args.connections, callgrind)
                key, value = ("instr", found["instructions_per_request"]) if callgrind else \
                    ("cpu", found["cpu_us_per_request"])
                figures[side][key].append(value)
                print(f"  {side} round {round_no + 1}{' callgrind' if callgrind else ''}: {key} {value} a request "
                      f"({found['errors']} errors)", flush=True)
    report: dict[str, Any] = {}
    for key, unit in (("instr", "instructions"), ("cpu", "proxy CPU us")):
        if not all(figures[side][key] for side in sides):
            continue  # no round of that kind (--rounds 0 or --callgrind-rounds 0)
        a, b = (statistics.median(figures[side][key]) for side in sides)
        report[key] = {"A": a, "B": b, "B/A": round(b / a, 4)}
        print(f"{unit} a request, median: A {a:,.1f}  B {b:,.1f}  B/A {b / a:.4f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"vs": args.vs, "figures": figures, **report}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m laswrr.bench.proxy_ab", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("measure", help="one stack, one proxy, one measurement (one JSON line)")
    one.add_argument("--requests", type=int, default=4000)
    one.add_argument("--connections", type=int, default=4)
    one.add_argument("--callgrind", action="store_true", help="the proxy under valgrind --tool=callgrind")
    one.add_argument("--idle-s", type=float, default=20.0,
                     help="under callgrind, seconds of idle measured after the requests (default 20)")
    one.add_argument("--cprofile", metavar="FILE", help="the proxy under cProfile, its stats written to FILE at "
                     "its exit (call counts: what the requests, start-up included, called how often)")
    one.add_argument("--hold", action="store_true", help="keep the stack up until stdin closes")
    gen = sub.add_parser("load", help="the fixed-count load generator alone (one JSON line)")
    gen.add_argument("--url", required=True)
    gen.add_argument("--requests", type=int, default=4000)
    gen.add_argument("--connections", type=int, default=4)
    parser.add_argument("--vs", help="the revision to compare this checkout with (A)")
    parser.add_argument("--rounds", type=int, default=3, help="probes per side without callgrind (default 3)")
    parser.add_argument("--callgrind-rounds", type=int, default=1, help="probes per side under callgrind (default 1)")
    parser.add_argument("--requests", type=int, default=4000, help="requests a probe without callgrind (default 4000)")
    parser.add_argument("--callgrind-requests", type=int, default=1000, help="requests a probe under callgrind")
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("bench-out/proxy_ab.json"), help="JSON results file")
    args = parser.parse_args(argv)
    if args.command == "measure":
        print(json.dumps(asyncio.run(probe(args))), flush=True)
        return 0
    if args.command == "load":
        print(json.dumps(asyncio.run(fixed_load(args.url, args.requests, args.connections))), flush=True)
        return 0
    if not args.vs:
        parser.error("give --vs REV, or a subcommand")
    return ab(args)


if __name__ == "__main__":
    sys.exit(main())
