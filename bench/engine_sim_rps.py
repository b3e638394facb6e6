"""How many requests per second one simulator process serves with every delay at zero.

Starts N simulator processes (or uses --url), drives them from this separate process
with an aiohttp client at each concurrency, non-streaming and streaming, each reply
exactly --tokens tokens, and prints req/s, tokens/s and the simulators' CPU seconds per
request (the capacity of one simulator core, independent of the client's own cost).

    .venv/bin/python bench/engine_sim_rps.py                 # 1 simulator, c=1 and c=64
    .venv/bin/python bench/engine_sim_rps.py --sims 2 --requests 20000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time

import aiohttp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZERO = [
    "--sim-load-seconds",
    "0",
    "--sim-ttft-ms",
    "0",
    "--sim-ttft-per-token-ms",
    "0",
    "--sim-decode-tps",
    "0",
    "--max-num-seqs",
    "256",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_sim(port: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "engine_sim",
        "bench/model",
        "--served-model-name",
        "m",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *ZERO,
    ]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def wait_ready(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(200):
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"simulator at {url} did not come up")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one(session: aiohttp.ClientSession, url: str, body: dict, stream: bool) -> int:
    """Send one request; return completion tokens as the server reported them."""
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        if not stream:
            return (await r.json())["usage"]["completion_tokens"]
        tokens = 0
        async for line in r.content:
            if line.startswith(b"data: {") and b'"usage"' in line:
                tokens = int(line.split(b'"completion_tokens":')[1].split(b"}")[0])
        return tokens


async def run_case(
    urls: list[str], concurrency: int, total: int, stream: bool, tokens: int
) -> tuple[float, int]:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    left = total
    got = 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def worker(k: int) -> None:
            nonlocal left, got
            url = urls[k % len(urls)]
            while left > 0:
                left -= 1
                n = await one(session, url, body, stream)
                got += n  # not `got += await ...`: that reads `got` before the await

        start = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        return time.perf_counter() - start, got


async def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sims", type=int, default=1, help="simulator processes to start")
    ap.add_argument("--url", action="append", help="use running simulator(s) instead")
    ap.add_argument("--requests", type=int, default=10000, help="requests per case")
    ap.add_argument("--tokens", type=int, default=16, help="completion tokens per reply")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    a = ap.parse_args()
    procs: list[subprocess.Popen] = []
    urls = a.url or []
    if not urls:
        for _ in range(a.sims):
            port = free_port()
            procs.append(start_sim(port))
            urls.append(f"http://127.0.0.1:{port}")
    try:
        for u in urls:
            await wait_ready(u)
        await run_case(urls, 8, 500, False, a.tokens)  # warm-up: imports, caches, connections
        print(
            f"{'mode':<10}{'conc':>6}{'requests':>10}{'req/s':>10}{'tok/s':>10}"
            f"{'sim CPU ms/req':>16}"
        )
        for stream in (False, True):
            for c in a.concurrency:
                cpu0 = sum(cpu_seconds(p.pid) for p in procs)
                secs, toks = await run_case(urls, c, a.requests, stream, a.tokens)
                cpu = sum(cpu_seconds(p.pid) for p in procs) - cpu0
                per = f"{1000 * cpu / a.requests:.3f}" if procs else "n/a"
                mode = "stream" if stream else "json"
                print(
                    f"{mode:<10}{c:>6}{a.requests:>10}{a.requests / secs:>10.0f}"
                    f"{toks / secs:>10.0f}{per:>16}",
                    flush=True,
                )
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=10)


if __name__ == "__main__":
    asyncio.run(main())
