"""The simulator against a real vLLM: the same load on both, TTFT and inter-token latency by concurrency.

    python -m laswrr.bench.calibrate [--max-num-seqs 4] [--concurrency 1,2,4,6,8] [--seconds 20]
                                     [--prompt-tokens 200] [--max-tokens 64] [--out bench-out/calibrate]

One real vLLM server (bench/real_vllm.py: the CPU build, the tiny model, ``--max-num-seqs N``) and
one simulated engine (``laswrr sim-engine``) configured to match it: N slots, and the ``--speed``
that makes its decode step with one request running last what the real engine's inter-token
latency is with one request (measured first). Then, for every concurrency c, c closed-loop
clients each stream chat completions of ``--prompt-tokens`` prompt tokens (counted by each
engine's own tokenizer: the real one's ``/tokenize``, the simulator's 4 characters a token) and
``--max-tokens`` output tokens for ``--seconds``, first on the real engine, then on the simulated
one, never both at once. Per engine and c: TTFT and inter-token latency (ITL: (last token - first
token) / (tokens - 1) of each request) at P50 and P99, requests/s, the most requests the engine's
``/metrics`` showed waiting, and its preemptions (``vllm:num_preemptions_total``). Past
``max_num_seqs`` (c > N) requests wait in both; how the wait and the step time grow is what the
comparison is for. Writes ``<out>/calibration.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from laswrr.bench import real_vllm
from laswrr.bench.metrics import percentile
from laswrr.services.nats_server import free_port
from laswrr.services.sim_engine.physics import EngineSim
from laswrr.services.sim_engine.profiles import get_profile

SIM_CHIP = "910B"
SIM_MODEL = "sim-calibration"


async def _metric(http: aiohttp.ClientSession, url: str, names: Sequence[str]) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


async def _one(http: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int
               ) -> tuple[float, float | None, int]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    began = time.monotonic()
    first = last = None
    tokens = 0
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                now = time.monotonic()
                first = first or now
                last = now
    assert first is not None and last is not None
    itl = (last - first) / (tokens - 1) if tokens > 1 else None
    return first - began, itl, tokens


async def level(url: str, model: str, prompt: str, max_tokens: int, concurrency: int, seconds: float
                ) -> dict[str, Any]:
    """``concurrency`` closed-loop clients for ``seconds``; the figures of the requests that ended."""
    ttfts: list[float] = []
    itls: list[float] = []
    waiting_max = 0.0
    names = ("vllm:num_requests_waiting", "vllm:num_preemptions_total")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        before = await _metric(http, url, names)
        deadline = time.monotonic() + seconds
        began = time.monotonic()

        async def client() -> None:
            while time.monotonic() < deadline:
                ttft, itl, _ = await _one(http, url, model, prompt, max_tokens)
                ttfts.append(ttft)
                if itl is not None:
                    itls.append(itl)

        async def watch() -> None:
            nonlocal waiting_max
            while time.monotonic() < deadline:
                waiting_max = max(waiting_max, (await _metric(http, url, names))["vllm:num_requests_waiting"])
                await asyncio.sleep(0.25)

        await asyncio.gather(watch(), *(client() for _ in range(concurrency)))
        elapsed = time.monotonic() - began
        after = await _metric(http, url, names)

    def ms(values: list[float], q: float) -> float | None:
        p = percentile(values, q)
        return None if p is None else round(p * 1000, 1)

    return {"concurrency": concurrency, "requests": len(ttfts), "rps": round(len(ttfts) / elapsed, 2),
            "ttft_p50_ms": ms(ttfts, 50), "ttft_p99_ms": ms(ttfts, 99), "itl_p50_ms": ms(itls, 50),
            "itl_p99_ms": ms(itls, 99), "waiting_max": int(waiting_max),
            "preemptions": int(after["vllm:num_preemptions_total"] - before["vllm:num_preemptions_total"])}


async def real_prompt(url: str, tokens: int) -> str:
    """A chat message of about ``tokens`` prompt tokens by the real engine's own count."""
    unit = "weights follow capacity and load on every node of the pool "
    text = unit * (tokens // 4 + 2)
    async with aiohttp.ClientSession() as http:
        lo, hi = 1, len(text)
        while lo < hi:  # the longest prefix of at most ``tokens`` tokens
            mid = (lo + hi + 1) // 2
            async with http.post(f"{url}/tokenize", json={"model": real_vllm.MODEL_NAME,
                                                          "messages": [{"role": "user", "content": text[:mid]}]}) as r:
                count = (await r.json())["count"]
            lo, hi = (mid, hi) if count <= tokens else (lo, mid - 1)
    return text[:lo]


def start_sim(capacity: int, speed: float, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with open(log, "ab") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "laswrr", "sim-engine", "--port", str(port), "--chip", SIM_CHIP,
                                 "--capacity", str(capacity), "--speed", f"{speed:.4f}", "--model", SIM_MODEL,
                                 "--log-level", "warning"], stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if real_vllm._get(f"{url}/health") == 200:
            return proc, url
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"sim-engine did not start; see {log}")


async def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    args.out.mkdir(parents=True, exist_ok=True)
    server = real_vllm.server(args.max_num_seqs, "vllm-calibration", args.out, num_blocks=args.num_blocks)
    print(f"starting a real vLLM (--max-num-seqs {args.max_num_seqs}); 1-3 minutes ...", flush=True)
    server.launch()  # in this thread: the engine gets SIGTERM when the thread that started it ends
    await asyncio.to_thread(server.wait_ready)
    levels = [int(c) for c in args.concurrency.split(",")]
    try:
        prompt = await real_prompt(server.url, args.prompt_tokens)
        await level(server.url, real_vllm.MODEL_NAME, prompt, args.max_tokens, 1, 3)  # warm-up
        real = [await level(server.url, real_vllm.MODEL_NAME, prompt, args.max_tokens, c, args.seconds)
                for c in levels]
    finally:
        await asyncio.to_thread(server.stop)
    one = next(r for r in real if r["concurrency"] == levels[0])
    sim_step1 = EngineSim(get_profile(SIM_CHIP), args.max_num_seqs).decode_step_s(1)
    speed = sim_step1 / (one["itl_p50_ms"] / 1000)
    proc, url = start_sim(args.max_num_seqs, speed, args.out / "sim-engine.log")
    try:
        sim_prompt = "x" * (4 * (args.prompt_tokens - 1))  # the simulator counts 4 characters a token, + 1
        sim = [await level(url, SIM_MODEL, sim_prompt, args.max_tokens, c, args.seconds) for c in levels]
    finally:
        proc.terminate()
        proc.wait(10)
    result = {"max_num_seqs": args.max_num_seqs, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
              "seconds": args.seconds, "vllm": real_vllm.VLLM_VERSION, "sim_chip": SIM_CHIP,
              "sim_speed": round(speed, 4), "real": real, "sim": sim}
    (args.out / "calibration.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def print_result(result: dict[str, Any]) -> None:
    print(f"max_num_seqs {result['max_num_seqs']}, prompt {result['prompt_tokens']} tokens, output "
          f"{result['max_tokens']}; sim {result['sim_chip']} --speed {result['sim_speed']} (its one-request step = the "
          "real one-request ITL); real / sim")
    print(f"{'c':>3} {'TTFT P50 ms':>17} {'TTFT P99 ms':>17} {'ITL P50 ms':>15} {'ITL P99 ms':>15} {'req/s':>11} "
          f"{'waiting max':>11} {'preempt.':>9}")
    for real, sim in zip(result["real"], result["sim"], strict=True):
        def pair(key: str) -> str:
            return f"{real[key]} / {sim[key]}"
        print(f"{real['concurrency']:>3} {pair('ttft_p50_ms'):>17} {pair('ttft_p99_ms'):>17} {pair('itl_p50_ms'):>15} "
              f"{pair('itl_p99_ms'):>15} {pair('rps'):>11} {pair('waiting_max'):>11} {pair('preemptions'):>9}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m laswrr.bench.calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--concurrency", default="1,2,4,6,8", metavar="LIST")
    parser.add_argument("--seconds", type=float, default=20.0, help="per concurrency level and engine")
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-blocks", type=int, default=None, help="the real engine's KV room (128-token blocks)")
    parser.add_argument("--out", type=Path, default=Path("bench-out") / "calibrate")
    args = parser.parse_args(argv)
    try:
        result = asyncio.run(calibrate(args))
    except real_vllm.VllmUnavailable as exc:
        print(f"calibrate: vLLM unavailable: {exc}", file=sys.stderr)
        return 1
    print_result(result)
    print(f"results: {args.out / 'calibration.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
