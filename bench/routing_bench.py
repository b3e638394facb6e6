"""Prefix-aware routing (issue 18): agent sessions on three replicas of one model.

Three simulator engines (one model, ``--max-num-seqs 12``, prefix caching on, a KV cache of
``--sim-kv-cache-tokens 160000`` each: room for the prefixes of about a third of the
sessions, as on a box that serves many agents) behind Tollgate (gunicorn, 2 uvicorn
workers) on a throw-away database (``tollgate_routebench``) and Redis prefix. Prefill
costs 30 ms + 0.1 ms a prompt token not in the engine's prefix cache (an 8k-token miss:
0.85 s), decode 60 tokens/s alone, bandwidth alpha 0.15.

30 agent sessions run at once, each replaying 20 turns one after the other: the first turn
is a session-specific 8,000-word system prompt (≈ 8k tokens) plus a 100-word user message;
every turn appends the assistant's streamed answer (16 tokens, ``ignore_eos``) and a new
100-word user message, so the prefix grows to ≈ 10.4k tokens. The same sessions run three
times, once per ``TOLLGATE_ROUTING`` policy (``prefix``, ``least_loaded``,
``round_robin``), each on freshly started engines (empty caches) and gateway.

Per policy: mean and p50/p90 time to first token at the client (a streamed chat request,
until the first content chunk), prompt tokens the engines prefilled vs took from their
prefix cache (``vllm:prompt_tokens_by_source_total``), requests per replica and the
max/min ratio of prefilled-plus-decoded work per replica (load imbalance).

    .venv/bin/python bench/routing_bench.py            # print the table
    .venv/bin/python bench/routing_bench.py --write    # and replace the section in RESULTS.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import orjson
from admission_bench import start_gateway
from gateway_bench import (
    PG,
    PY,
    ROOT,
    Server,
    free_port,
    load_avg,
    psql,
    replace_block,
    sh,
    wait_listening,
)

DB_NAME = "tollgate_routebench"
MODEL = "bench-model"  # admission_bench.start_gateway waits for this name
REPLICAS = 3
SLOTS = 12
SECTION = "## Prefix-aware routing"
BEGIN, END = ("<!-- routing_bench.py --write: begin -->", "<!-- routing_bench.py --write: end -->")
POLICIES = ("prefix", "least_loaded", "round_robin")
SIM_ARGS = [
    "--max-num-seqs",
    str(SLOTS),
    "--max-model-len",
    "32768",
    "--sim-kv-cache-tokens",
    "160000",
    "--sim-load-seconds",
    "0",
    "--sim-ttft-ms",
    "30",
    "--sim-ttft-per-token-ms",
    "0.1",
    "--sim-decode-tps",
    "60",
    "--sim-bandwidth-alpha",
    "0.15",
    "--enable-prompt-tokens-details",
]
WORDS = (
    "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega build test deploy "
    "function class module import return value error retry cache token replica engine "
    "request stream answer file path line change commit branch merge review patch"
).split()
METRIC = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", re.M)

SETUP = """
import json, sys
from decimal import Decimal
from deployments import services as ds
from deployments.choices import ReplicaState
from deployments.models import Deployment, Replica
from tenants import services as ts
node = ds.register_node(None, name="routebench", docker_url="unix:///x", engine_host="127.0.0.1")
model = ds.create_model(None, served_name="%(model)s", source="sim/%(model)s", task="generate",
    params_billions=Decimal("8"), context_length=32768, visibility="public")
dep = Deployment.objects.create(name="routebench", model=model, node=node,
    image="tollgate/engine-sim:latest", engine_args={"max-num-seqs": %(slots)d},
    desired_state="running", state="ready", replicas=%(n)d)
for i, port in enumerate(%(ports)s):
    Replica.objects.create(deployment=dep, index=i, node=node, host="127.0.0.1", port=port,
        state=ReplicaState.READY, healthy=True)
none = {"requests_per_minute": None, "tokens_per_minute": None, "max_concurrent_requests": None}
tenant = ts.create_tenant(None, name="agents", slug="agents", quota_tokens=None, **none)
print(json.dumps({"key": ts.issue_api_key(None, tenant, name="agents", **none).plaintext}))
"""


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def start_engines() -> tuple[list[int], list[Server]]:
    ports, servers = [], []
    for _ in range(REPLICAS):
        port = free_port()
        cmd = [PY, "-m", "engine_sim", MODEL, "--host", "127.0.0.1", "--port", str(port)]
        proc = subprocess.Popen(
            [*cmd, *SIM_ARGS], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        servers.append(Server(proc))
        wait_listening(port, proc)
        ports.append(port)
    return ports, servers


def engine_figures(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name, labels, value in METRIC.findall(text):
        if name == "vllm:prompt_tokens_by_source_total":
            source = re.search(r'source="([a-z_]+)"', labels).group(1)
            out[f"prompt_{source}"] = out.get(f"prompt_{source}", 0) + float(value)
        elif name == "vllm:request_success_total":
            out["requests"] = out.get("requests", 0) + float(value)
        elif name == "vllm:generation_tokens_total":
            out["generated"] = out.get("generated", 0) + float(value)
    return out


async def session(
    http: aiohttp.ClientSession, url: str, key: str, index: int, turns: int, ttfts: list
) -> None:
    rng = random.Random(index)
    messages = [
        {"role": "system", "content": f"Session {index}. " + words(rng, 8000)},
        {"role": "user", "content": words(rng, 100)},
    ]
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    for turn in range(turns):
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": 16,
            "ignore_eos": True,
            "stream": True,
        }
        started, first, answer = time.perf_counter(), None, []
        async with http.post(url, data=orjson.dumps(body), headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"turn {turn} of session {index}: {await resp.text()}")
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                for choice in orjson.loads(line[6:]).get("choices", ()):
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        first = first or time.perf_counter()
                        answer.append(piece)
        ttfts.append((first - started) * 1000)
        messages = [
            *messages,
            {"role": "assistant", "content": "".join(answer)},
            {"role": "user", "content": words(rng, 100)},
        ]


async def drive(url: str, key: str, sessions: int, turns: int) -> tuple[list[float], float]:
    ttfts: list[float] = []
    connector = aiohttp.TCPConnector(limit=sessions)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        started = time.perf_counter()
        await asyncio.gather(
            *(
                session(http, url + "/v1/chat/completions", key, i, turns, ttfts)
                for i in range(sessions)
            )
        )
    return ttfts, time.perf_counter() - started


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_policy(policy: str, sessions: int, turns: int) -> dict:
    """Fresh engines, database rows and gateway for one policy; the sessions; the figures."""
    prefix = f"routebench-{secrets.token_hex(4)}"
    tmp = Path(tempfile.mkdtemp(prefix="routebench-"))
    env = {
        **os.environ,
        "TOLLGATE_ENV": "test",
        "DATABASE_URL": f"{PG}/{DB_NAME}",
        "TOLLGATE_REDIS_PREFIX": prefix,
        "TOLLGATE_LOG_LEVEL": "WARNING",
        "TOLLGATE_ROUTING": policy,
        "PROMETHEUS_MULTIPROC_DIR": str(tmp / "prom"),  # emptied by config/gunicorn.py
    }
    servers: list[Server] = []
    import redis

    client = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    try:
        ports, engines = start_engines()
        servers += engines
        psql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        psql(f"CREATE DATABASE {DB_NAME}")
        sh([PY, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=env)
        code = SETUP % {"model": MODEL, "slots": SLOTS, "n": REPLICAS, "ports": ports}
        out = sh([PY, "manage.py", "shell", "-c", code], cwd=ROOT, env=env)
        key = json.loads(out.strip().splitlines()[-1])["key"]
        url, gateway = start_gateway(env, key, tmp / "gateway.log", 2)
        servers.append(gateway)
        print(f"{policy}: {sessions} sessions × {turns} turns …", file=sys.stderr, flush=True)
        ttfts, wall = asyncio.run(drive(url, key, sessions, turns))
        per_replica = [engine_figures(p) for p in ports]
    finally:
        for srv in reversed(servers):
            with contextlib.suppress(Exception):
                srv.stop()
        with contextlib.suppress(subprocess.CalledProcessError):
            psql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        with contextlib.suppress(Exception):
            keys = list(client.scan_iter(f"{prefix}:*", count=1000))
            for i in range(0, len(keys), 500):
                client.delete(*keys[i : i + 500])
        shutil.rmtree(tmp, ignore_errors=True)
    # Work per replica: tokens prefilled (not from cache) plus tokens decoded.
    work = [r.get("prompt_local_compute", 0) + r.get("generated", 0) for r in per_replica]
    return {
        "ttft_mean": sum(ttfts) / len(ttfts),
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p90": percentile(ttfts, 0.9),
        "requests": len(ttfts),
        "wall": wall,
        "prefilled": sum(r.get("prompt_local_compute", 0) for r in per_replica),
        "cached": sum(r.get("prompt_local_cache_hit", 0) for r in per_replica),
        "per_replica": [int(r.get("requests", 0)) for r in per_replica],
        "imbalance": max(work) / min(work) if min(work) else float("inf"),
    }


def report(res: dict[str, dict]) -> tuple[str, list[str]]:
    lines = [
        "| routing | mean TTFT, ms | p50 / p90 TTFT, ms | prompt tokens prefilled | from prefix "
        "cache | requests per replica | work max/min | wall, s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for policy, r in res.items():
        share = r["cached"] / max(r["cached"] + r["prefilled"], 1)
        lines.append(
            f"| {policy} | {r['ttft_mean']:,.0f} | {r['ttft_p50']:,.0f} / {r['ttft_p90']:,.0f} | "
            f"{r['prefilled']:,.0f} | {r['cached']:,.0f} ({share:.0%}) | "
            f"{' / '.join(str(n) for n in r['per_replica'])} | {r['imbalance']:.2f} | "
            f"{r['wall']:.1f} |"
        )
    verdict = []
    if "prefix" in res and "round_robin" in res:
        gain = res["round_robin"]["ttft_mean"] / res["prefix"]["ttft_mean"]
        imbalance = res["prefix"]["imbalance"]
        verdict.append(
            f"- prefix-aware mean TTFT ≥ 2× lower than round-robin: "
            f"{'met' if gain >= 2 else 'MISSED'} ({gain:.2f}× lower)"
        )
        verdict.append(
            f"- load imbalance (max/min work per replica) with prefix-aware routing ≤ 1.3: "
            f"{'met' if imbalance <= 1.3 else 'MISSED'} ({imbalance:.2f})"
        )
    return "\n".join(lines), verdict


def write_section(block: str) -> None:
    """Replace this bench's generated block in bench/RESULTS.md."""
    replace_block(SECTION, BEGIN, END, block)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--write", action="store_true", help="replace the section in RESULTS.md")
    ap.add_argument("--sessions", type=int, default=30)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--policies", default=",".join(POLICIES))
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    before = load_avg()
    res = {p: run_policy(p, a.sessions, a.turns) for p in a.policies.split(",")}
    after = load_avg()
    text, verdict = report(res)
    cmd = "$ .venv/bin/python bench/routing_bench.py " + " ".join(sys.argv[1:])
    machine = (
        f"`nproc` {os.cpu_count()}, `uname -m` {platform.machine()}, Python "
        f"{platform.python_version()}; {started}; gateway `gunicorn -w 2`; load average "
        f"before {before}, after {after}"
    )
    out = f"{cmd.strip()}\n{machine}\n\n{text}\n\n" + "\n".join(verdict)
    print("\n" + out)
    if a.write:
        write_section(
            f"Latest run: {machine}.\n\n```\n{cmd.strip()}\n```\n\n{text}\n\nTargets:\n\n"
            + "\n".join(verdict)
            + "\n"
        )


if __name__ == "__main__":
    main()
