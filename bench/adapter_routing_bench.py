"""LoRA adapter routing (issue 29): requests sent to a replica that holds their adapter,
against routing that ignores where adapters are.

Three simulator engines of one base model (``--max-num-seqs 8``, ``--enable-lora
--max-loras 2``, prefill 60 ms + 0.1 ms a prompt token, decode 50 tokens/s alone, bandwidth
alpha 0.15) behind the whole appliance (bench/gateway_appliance.py: web ``gunicorn -w 2``
with production settings, worker, beat, usage consumer), on a throw-away database
(``tollgate_adapterbench``, cloned from a migrated template) and Redis prefix. The worker
consumes ``control``, where the gateway sends its loads (``TOLLGATE_DEMAND_QUEUE=control``
set explicitly), and loads adapters into the engines with its LRU unloading at the
deployment's adapter slots (``--max-cpu-loras``, else ``--max-loras``).

A load takes ``--sim-lora-load-ms 300`` on the engines, and so does reading an adapter again
after it fell out of the engine's ``--max-cpu-loras`` cache. Why 300 ms: on the real vLLM CPU
build a load of the repository's tiny test adapters takes 50–110 ms idle and about 0.7 s
while the engine streams (measured on this machine); on a GPU a real adapter of tens to
hundreds of MB is read from disk and copied to the device, about as long or longer. The
simulator does not model that a real load also holds up the other requests' next tokens
(it runs between the engine's steps), so every load costs the real engine more than here.

Ten adapters of four tenants (private, one tenant's key each), staged in a Hugging Face
cache the engines read (``HF_HOME``), with Zipf popularity (weight 1/rank: the first takes
34 % of requests, the last 3.4 %). ``--clients`` (12) closed-loop clients stream short chats
(a 40–120-word prompt, 48–96 tokens, ``ignore_eos``) for ``--seconds`` each run, each request
on an adapter drawn by popularity and sent with its tenant's key. The first ``--warm``
seconds (the cold loads) are left out of every figure. Each configuration (``--cpu-loras``:
the engines' ``--max-cpu-loras``, so the adapters a replica keeps) runs once per mode and
round, ``TOLLGATE_ADAPTER_ROUTING=loaded`` then ``=ignore`` (swapped every other round),
each run on fresh engines, database and appliance:

  loaded   the gateway's routing: a replica holding the adapter (least-loaded or
           prefix-aware among those), a load only when none holds it or all holders are
           busy past ``TOLLGATE_ADAPTER_SPREAD_LOAD``
  ignore   the least-loaded replica wherever the adapter is, loading it there if need be

Per mode (the rounds pooled): client-side time to first token (median and p90; of the
popular three adapters and of the other seven), errors, the loads the gateway asked for
(``tollgate_adapter_loads_requested_total``) and the loads and unloads the worker did (its
log), the requests that waited for a load and how long (``tollgate_adapter_load_wait_seconds``:
count, mean, and the bucket holding the 90th percentile), the requests the engines kept
waiting for one of their ``--max-loras`` LoRA slots (``vllm:num_requests_waiting_by_reason
{reason="deferred"}``, sampled twice a second: the mean), and requests per replica (each
engine's ``vllm:request_success_total``). The worker's loads and unloads are replayed in
order to tell how many loads put a further copy of an adapter another replica held, how
many unloads came while another replica had a free place, and how the warm-up's loads fell
over the replicas; what each replica held at the end closes each mode. The machine is
shared and noisy: compare the two modes within one run (each round's p50 and loads are
printed too).

    .venv/bin/python bench/adapter_routing_bench.py            # print the tables
    .venv/bin/python bench/adapter_routing_bench.py --write    # and replace its RESULTS.md section
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
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import orjson
import redis
from gateway_appliance import start_appliance
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

DB_NAME = "tollgate_adapterbench"
TEMPLATE = f"{DB_NAME}_template"
BASE = "bench-base"
REPLICAS = 3
SEQS = 8
MAX_LORAS = 2
LOAD_MS = 300
QUEUE = "control"  # one of the queues bench/gateway_appliance.py's worker consumes
MODES = ("loaded", "ignore")
POPULAR = 3  # the adapters reported apart as "popular"
SECTION = "## LoRA adapter routing"
BEGIN, END = (
    "<!-- adapter_routing_bench.py --write: begin -->",
    "<!-- adapter_routing_bench.py --write: end -->",
)
TENANTS = ("acme", "globex", "initech", "umbrella")
# (served name, tenant), most popular first; the tenants' adapters are spread over the ranks.
ADAPTERS = [
    ("acme-support", "acme"),
    ("globex-legal", "globex"),
    ("initech-code", "initech"),
    ("umbrella-med", "umbrella"),
    ("acme-sales", "acme"),
    ("globex-hr", "globex"),
    ("initech-sql", "initech"),
    ("acme-tone", "acme"),
    ("umbrella-lab", "umbrella"),
    ("globex-tax", "globex"),
]
WEIGHTS = [1 / rank for rank in range(1, len(ADAPTERS) + 1)]  # Zipf, s = 1
SIM_ARGS = (
    f"--max-num-seqs {SEQS} --max-model-len 8192 --enable-lora --max-loras {MAX_LORAS} "
    "--max-lora-rank 16 --sim-load-seconds 0 --sim-ttft-ms 60 --sim-ttft-per-token-ms 0.1 "
    f"--sim-decode-tps 50 --sim-bandwidth-alpha 0.15 --sim-lora-load-ms {LOAD_MS}"
).split()
WORDS = (
    "order invoice refund policy contract clause patient dosage query table index deploy "
    "customer account balance schedule meeting report summary review draft tone formal "
    "friendly please explain why how when which list steps example short answer"
).split()
LOADED = re.compile(r"adapter (\S+) loaded into replica (\d+)")
UNLOADED = re.compile(r"adapter (\S+) unloaded from replica (\d+)")
MISSING = re.compile(r"^404 The model `([^`]+)` does not exist")

SETUP = """
import json
from decimal import Decimal
from deployments import services as ds
from deployments.choices import AdapterStatus, ReplicaState, Visibility
from deployments.models import Adapter, Deployment, Replica
from tenants import services as ts
node = ds.register_node(None, name="bench-node", docker_url="unix:///x", engine_host="127.0.0.1")
model = ds.create_model(None, served_name=%(base)r, source="sim/base", task="generate",
    params_billions=Decimal("8"), context_length=8192, visibility="public")
args = {"max-num-seqs": %(seqs)d, "enable-lora": True, "max-loras": %(loras)d,
    "max-cpu-loras": %(cpu)d, "max-lora-rank": 16}
dep = Deployment.objects.create(name="adapterbench", model=model, node=node,
    image="tollgate/engine-sim:latest", engine_args=args, desired_state="running",
    state="ready", replicas=%(n)d)
replicas = {}
for i, port in enumerate(%(ports)s):
    replicas[port] = Replica.objects.create(deployment=dep, index=i, node=node,
        host="127.0.0.1", port=port, state=ReplicaState.READY, healthy=True).pk
none = {"requests_per_minute": None, "tokens_per_minute": None, "max_concurrent_requests": None}
keys, tenants = {}, {}
for slug in %(tenants)r:
    tenants[slug] = ts.create_tenant(None, name=slug, slug=slug, quota_tokens=None, **none)
    keys[slug] = ts.issue_api_key(None, tenants[slug], name=slug, **none).plaintext
for name, slug in %(adapters)r:
    # Its files are not checked by a helper container here: staged ready, as after a check.
    Adapter.objects.create(served_name=name, base=model, tenant=tenants[slug],
        visibility=Visibility.PRIVATE, source=f"{slug}/{name}-lora", rank=8,
        target_modules=["q_proj", "v_proj"], status=AdapterStatus.READY)
print(json.dumps({"keys": keys, "replicas": replicas}))
"""


@dataclass
class Req:
    """One client request: its adapter's popularity rank, when it started (seconds into the
    run), its time to first token, its HTTP status and what went wrong (empty: nothing)."""

    rank: int
    at: float
    ttft_ms: float | None
    status: int
    error: str = ""


# --- the stack -------------------------------------------------------------------------------


def stage_adapters(hf_home: Path) -> None:
    """Each adapter in the Hugging Face cache's layout, as a download (or Tollgate) leaves it."""
    for name, slug in ADAPTERS:
        repo = hf_home / "hub" / f"models--{slug}--{name}-lora"
        folder = repo / "snapshots" / "0123abcd"
        folder.mkdir(parents=True)
        config = {"peft_type": "LORA", "r": 8, "target_modules": ["q_proj", "v_proj"]}
        (folder / "adapter_config.json").write_text(json.dumps(config))
        (folder / "adapter_model.safetensors").write_bytes(b"\0" * 64)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0123abcd")


def start_engines(hf_home: Path, cpu_loras: int, tmp: Path) -> tuple[list[int], list[Server]]:
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "HF_HOME": str(hf_home)}
    ports, servers = [], []
    for i in range(REPLICAS):
        port = free_port()
        cmd = [PY, "-m", "engine_sim", BASE, "--host", "127.0.0.1", "--port", str(port)]
        log = open(tmp / f"engine-{i}.log", "a")  # noqa: SIM115 - the process's
        proc = subprocess.Popen(
            [*cmd, *SIM_ARGS, "--max-cpu-loras", str(cpu_loras)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        servers.append(Server(proc))
        wait_listening(port, proc)
        ports.append(port)
    return ports, servers


def make_template(env: dict) -> None:
    """A migrated database each run's is cloned from (migrating takes longer than a clone)."""
    psql(f"DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)")
    psql(f"CREATE DATABASE {TEMPLATE}")
    sh([PY, "manage.py", "migrate", "--noinput"], cwd=ROOT, env={**env, **db_env(TEMPLATE)})


def db_env(name: str) -> dict:
    return {"DATABASE_URL": f"{PG}/{name}"}


def engine_requests(port: int) -> float:
    """Requests the engine finished (``vllm:request_success_total``, every reason)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


def engine_now(port: int) -> list[int]:
    """The engine's requests now: [kept waiting for a LoRA slot (vLLM's ``--max-loras``
    budget: ``vllm:num_requests_waiting_by_reason{reason="deferred"}``), running, waiting]."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    now = [0.0, 0.0, 0.0]
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_waiting_by_reason{") and "deferred" in line:
            now[0] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:num_requests_running{"):
            now[1] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:num_requests_waiting{"):
            now[2] += float(line.rsplit(" ", 1)[1])
    return [int(v) for v in now]


def gateway_figures(url: str, token: str) -> dict:
    """The gateway's adapter counters, summed over adapters: loads asked, load waits (count,
    seconds, cumulative buckets) and requests refused for an adapter not loaded in time."""
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    out: dict = {"loads": 0.0, "waits": 0.0, "wait_s": 0.0, "buckets": {}, "refused": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "tollgate_adapter_loads_requested_total":
                out["loads"] += s.value
            elif s.name == "tollgate_adapter_load_wait_seconds_count":
                out["waits"] += s.value
            elif s.name == "tollgate_adapter_load_wait_seconds_sum":
                out["wait_s"] += s.value
            elif s.name == "tollgate_adapter_load_wait_seconds_bucket":
                le = s.labels["le"]
                out["buckets"][le] = out["buckets"].get(le, 0.0) + s.value
            elif s.name == "tollgate_rejections_total" and "adapter" in s.labels.get("reason", ""):
                out["refused"] += s.value
    return out


def held(port: int) -> list[str]:
    """The adapters the engine serves now (its /v1/models cards after the base's)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
        return [card["id"] for card in json.load(r)["data"] if card.get("parent")]


def worker_changes(text: str) -> list[tuple[str, str, int]]:
    """The loads and unloads in the worker's log, in order: (``+`` or ``-``, adapter, replica
    id)."""
    changes = [(m.start(), "+", m[1], int(m[2])) for m in LOADED.finditer(text)]
    changes += [(m.start(), "-", m[1], int(m[2])) for m in UNLOADED.finditer(text)]
    return [change[1:] for change in sorted(changes)]


# --- the clients -----------------------------------------------------------------------------


def said(body: str) -> str:
    """An error answer's message (the body itself when it is not OpenAI's error JSON)."""
    try:
        return str(json.loads(body)["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return body[:200]


async def client(
    http: aiohttp.ClientSession,
    url: str,
    keys: dict[str, str],
    index: int,
    t0: float,
    stop_at: float,
    out: list[Req],
) -> None:
    rng = random.Random(index * 7919 + int(t0))
    ranks = list(range(len(ADAPTERS)))
    while time.perf_counter() < stop_at:
        rank = rng.choices(ranks, WEIGHTS)[0]
        name, slug = ADAPTERS[rank]
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120)))
        body = {
            "model": name,
            "messages": [
                {"role": "system", "content": f"You are {slug}'s assistant."},
                {"role": "user", "content": prompt},
            ],
            "max_tokens": rng.randint(48, 96),
            "ignore_eos": True,
            "stream": True,
        }
        headers = {"authorization": f"Bearer {keys[slug]}", "content-type": "application/json"}
        started, first, status, error = time.perf_counter(), None, 0, ""
        try:
            async with http.post(url, data=orjson.dumps(body), headers=headers) as resp:
                status = resp.status
                if status != 200:
                    error = said(await resp.text())
                else:
                    async for line in resp.content:
                        if not line.startswith(b"data: {"):
                            continue
                        event = orjson.loads(line[6:])
                        if "error" in event:
                            error = said(json.dumps(event))
                        for choice in event.get("choices", ()):
                            if (choice.get("delta") or {}).get("content") and first is None:
                                first = time.perf_counter()
        except (aiohttp.ClientError, TimeoutError) as exc:
            error = repr(exc)[:300]
        ttft = (first - started) * 1000 if first is not None else None
        out.append(Req(rank, started - t0, ttft, status, error))
        if error or status != 200:
            await asyncio.sleep(0.5)  # as a client honouring retry-after would, a little


async def drive(url: str, keys: dict[str, str], clients: int, seconds: float) -> list[Req]:
    out: list[Req] = []
    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=180)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        t0 = time.perf_counter()
        stop_at = t0 + seconds
        target = url + "/v1/chat/completions"
        await asyncio.gather(
            *(client(http, target, keys, i, t0, stop_at, out) for i in range(clients))
        )
    return out


# --- one run ---------------------------------------------------------------------------------


def run_once(mode: str, cpu_loras: int, a: argparse.Namespace, base_env: dict) -> dict:
    """Fresh engines, database and appliance; the clients; the figures after the warm-up."""
    prefix = f"adapterbench-{secrets.token_hex(4)}"
    tmp = Path(tempfile.mkdtemp(prefix="adapterbench-"))
    (tmp / "prom").mkdir()
    hf_home = tmp / "hf"
    stage_adapters(hf_home)
    token = secrets.token_urlsafe(16)
    env = {
        **base_env,
        **db_env(DB_NAME),
        "TOLLGATE_REDIS_PREFIX": prefix,
        "TOLLGATE_METRICS_TOKEN": token,
        "PROMETHEUS_MULTIPROC_DIR": str(tmp / "prom"),
        "TOLLGATE_ADAPTER_ROUTING": mode,
        "TOLLGATE_DEMAND_QUEUE": QUEUE,
    }
    client_redis = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    servers: list = []
    failed = True
    try:
        ports, engines = start_engines(hf_home, cpu_loras, tmp)
        servers += engines
        psql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        psql(f"CREATE DATABASE {DB_NAME} TEMPLATE {TEMPLATE}")
        code = SETUP % {
            "base": BASE,
            "seqs": SEQS,
            "loras": MAX_LORAS,
            "cpu": cpu_loras,
            "n": REPLICAS,
            "ports": ports,
            "tenants": TENANTS,
            "adapters": ADAPTERS,
        }
        rows = json.loads(
            sh([PY, "manage.py", "shell", "-c", code], cwd=ROOT, env=env).strip().splitlines()[-1]
        )
        keys = rows["keys"]
        replica_ids = [rows["replicas"][str(p)] for p in ports]
        url, appliance = start_appliance(
            a.workers, env, keys[TENANTS[0]], tmp, frozenset({BASE, ADAPTERS[0][0]})
        )
        servers.append(appliance)
        worker_log = tmp / "appliance-worker.log"
        print(f"{mode}, --max-cpu-loras {cpu_loras}: {a.clients} clients × {a.seconds:g} s …",
              file=sys.stderr, flush=True)  # fmt: skip
        marks: dict = {}
        samples: list[list[list[int]]] = []  # per sample, per replica: engine_now

        async def run() -> list[Req]:
            async def mark() -> None:
                await asyncio.sleep(a.warm)
                marks["gateway"] = await asyncio.to_thread(gateway_figures, url, token)
                marks["engines"] = [await asyncio.to_thread(engine_requests, p) for p in ports]
                marks["worker_log"] = len(worker_log.read_text(errors="replace"))

            async def sample() -> None:
                await asyncio.sleep(a.warm)
                while time.perf_counter() < stop_at:
                    samples.append([await asyncio.to_thread(engine_now, p) for p in ports])
                    await asyncio.sleep(0.5)

            stop_at = time.perf_counter() + a.seconds
            marker, sampler = asyncio.create_task(mark()), asyncio.create_task(sample())
            got = await drive(url, keys, a.clients, a.seconds)
            await marker
            await sampler
            return got

        requests = asyncio.run(run())
        time.sleep(1.5)  # the workers' last counts reach the metrics files
        gw = gateway_figures(url, token)
        engines_done = [engine_requests(p) for p in ports]
        held_end = [held(p) for p in ports]
        log = worker_log.read_text(errors="replace")
        changes = worker_changes(log)
        cold = len(worker_changes(log[: marks["worker_log"]]))
        failed = False
    finally:
        for srv in reversed(servers):
            with contextlib.suppress(Exception):
                srv.stop()
        with contextlib.suppress(subprocess.CalledProcessError):
            psql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        with contextlib.suppress(Exception):
            stale = list(client_redis.scan_iter(f"{prefix}:*", count=1000))
            for i in range(0, len(stale), 500):
                client_redis.delete(*stale[i : i + 500])
        if failed:
            print(f"logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    before = marks["gateway"]
    return {
        "mode": mode,
        "cpu_loras": cpu_loras,
        "requests": [asdict(r) for r in requests if r.at >= a.warm],
        "loads_asked": gw["loads"] - before["loads"],
        "loads_asked_cold": before["loads"],
        "waits": gw["waits"] - before["waits"],
        "wait_s": gw["wait_s"] - before["wait_s"],
        "wait_buckets": {le: n - before["buckets"].get(le, 0.0) for le, n in gw["buckets"].items()},
        "refused": gw["refused"] - before["refused"],
        "engine_samples": samples,
        "per_replica": [int(e - b) for e, b in zip(engines_done, marks["engines"], strict=True)],
        "loads_done": [sum(c[::2] == ("+", rid) for c in changes[cold:]) for rid in replica_ids],
        "unloads_done": [sum(c[::2] == ("-", rid) for c in changes[cold:]) for rid in replica_ids],
        # What the worker did, in order: [+/-, adapter, replica index]; the first ``cold``
        # during the warm-up.
        "changes": [[sign, name, replica_ids.index(rid)] for sign, name, rid in changes],
        "cold": cold,
        "held_end": held_end,
    }


# --- the report ------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def bucket_p90(buckets: dict[str, float]) -> str:
    """The smallest histogram bound at or under which 90 % of the waits fell."""
    bounds = sorted(((float(le), n) for le, n in buckets.items()), key=lambda b: b[0])
    total = bounds[-1][1] if bounds else 0
    if not total:
        return "—"
    for le, n in bounds:
        if n >= 0.9 * total:
            return "> 300 s" if le == float("inf") else f"≤ {le:g} s"
    return "—"


def replay(run: dict) -> tuple[int, int]:
    """The worker's changes after the warm-up, replayed from empty replicas: loads that put
    a further copy of an adapter another replica held, and unloads made while another replica
    had a free place (not one it just emptied to load another: the worker unloads first)."""
    places: list[set[str]] = [set() for _ in range(REPLICAS)]
    last = ["+"] * REPLICAS
    copies = roomy = 0
    for i, (sign, name, rep) in enumerate(run.get("changes", ())):
        others = [j for j in range(REPLICAS) if j != rep]
        if sign == "+":
            copies += i >= run["cold"] and any(name in places[j] for j in others)
            places[rep].add(name)
        else:
            free = [j for j in others if len(places[j]) < run["cpu_loras"] and last[j] == "+"]
            roomy += i >= run["cold"] and bool(free)
            places[rep].discard(name)
        last[rep] = sign
    return copies, roomy


def cold_changes(run: dict) -> tuple[list[int], list[int]]:
    """Loads and unloads per replica during the warm-up (the cold start)."""
    changes = run.get("changes", ())[: run.get("cold", 0)]
    loads = [sum(1 for s, _, r in changes if (s, r) == ("+", j)) for j in range(REPLICAS)]
    unloads = [sum(1 for s, _, r in changes if (s, r) == ("-", j)) for j in range(REPLICAS)]
    return loads, unloads


def pooled(runs: list[dict]) -> dict:
    """One mode's rounds as one."""
    reqs = [r for run in runs for r in run["requests"]]
    ok = [r for r in reqs if r["status"] == 200 and not r["error"] and r["ttft_ms"] is not None]
    ttft = [r["ttft_ms"] for r in ok]
    errors: dict[str, int] = {}
    for r in reqs:
        if r["status"] != 200 or r["error"] or r["ttft_ms"] is None:
            kind = f"{r['status'] or ''} {r['error'] or 'no first token'}".strip()
            errors[kind] = errors.get(kind, 0) + 1
    buckets: dict[str, float] = {}
    for run in runs:
        for le, n in run["wait_buckets"].items():
            buckets[le] = buckets.get(le, 0.0) + n
    waits = sum(run["waits"] for run in runs)
    return {
        "requests": len(reqs),
        "ok": len(ok),
        "errors": errors,
        "p50": percentile(ttft, 0.5),
        "p90": percentile(ttft, 0.9),
        "p50_popular": percentile([r["ttft_ms"] for r in ok if r["rank"] < POPULAR], 0.5),
        "p50_tail": percentile([r["ttft_ms"] for r in ok if r["rank"] >= POPULAR], 0.5),
        "p90_tail": percentile([r["ttft_ms"] for r in ok if r["rank"] >= POPULAR], 0.9),
        "loads_asked": sum(run["loads_asked"] for run in runs),
        "loads_cold": sum(run["loads_asked_cold"] for run in runs),
        "loads_done": sum(sum(run["loads_done"]) for run in runs),
        "unloads_done": sum(sum(run["unloads_done"]) for run in runs),
        "waits": waits,
        "wait_mean_ms": sum(run["wait_s"] for run in runs) / waits * 1000 if waits else None,
        "wait_p90": bucket_p90(buckets),
        "refused": sum(run["refused"] for run in runs),
        "cold_loads": [sum(n) for n in zip(*(cold_changes(r)[0] for r in runs), strict=True)],
        "cold_unloads": [sum(n) for n in zip(*(cold_changes(r)[1] for r in runs), strict=True)],
        "copies": sum(replay(run)[0] for run in runs),
        "roomy": sum(replay(run)[1] for run in runs),
        "deferred": sum(d for run in runs for sample in run["engine_samples"] for d, _, _ in sample)
        / max(sum(len(run["engine_samples"]) for run in runs), 1),
        "per_replica": [sum(n) for n in zip(*(run["per_replica"] for run in runs), strict=True)],
        "round_p50": [
            percentile(
                [
                    r["ttft_ms"]
                    for r in run["requests"]
                    if r["status"] == 200 and not r["error"] and r["ttft_ms"] is not None
                ],
                0.5,
            )
            for run in runs
        ],
        "round_loads": [run["loads_asked"] for run in runs],
    }


def error_kinds(errors: dict[str, int]) -> str:
    """The errors by kind; the engine's "model does not exist" once, naming the adapters."""
    missing: dict[str, int] = {}
    kinds: list[str] = []
    for kind, n in sorted(errors.items()):
        found = MISSING.search(kind)
        if found:
            missing[found[1]] = missing.get(found[1], 0) + n
        else:
            kinds.append(f"{n} × {kind}")
    if missing:
        names = ", ".join(f"{name} {n}" for name, n in sorted(missing.items()))
        kinds.insert(0, f"{sum(missing.values())} × 404 “The model `…` does not exist” ({names})")
    return "; ".join(kinds) or "none"


def ms(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f}"


def report(raw: dict, a: argparse.Namespace) -> tuple[str, list[str]]:
    lines: list[str] = []
    verdict: list[str] = []
    for cpu, by_mode in raw.items():
        res = {mode: pooled(runs) for mode, runs in by_mode.items()}
        slots = int(cpu)
        lines += [
            f"### {slots} adapters kept per replica (`--max-loras {MAX_LORAS} --max-cpu-loras "
            f"{slots}`: {REPLICAS * slots} places for {len(ADAPTERS)} adapters)",
            "",
            "| routing | requests (ok) | TTFT p50 / p90, ms | popular 3: p50 | other 7: p50 / "
            "p90 | loads asked (cold) | loads / unloads done | waited for a load | mean wait, "
            "ms | p90 wait | waiting for a LoRA slot | requests per replica | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for mode, r in res.items():
            by_status: dict[str, int] = {}
            for kind, n in r["errors"].items():
                by_status[kind.split()[0]] = by_status.get(kind.split()[0], 0) + n
            errors = ", ".join(f"{n} × {s}" for s, n in by_status.items()) or "none"
            lines.append(
                f"| {mode} | {r['requests']} ({r['ok']}) | {ms(r['p50'])} / {ms(r['p90'])} "
                f"| {ms(r['p50_popular'])} | {ms(r['p50_tail'])} / {ms(r['p90_tail'])} "
                f"| {r['loads_asked']:.0f} ({r['loads_cold']:.0f}) "
                f"| {r['loads_done']} / {r['unloads_done']} | {r['waits']:.0f} "
                f"| {ms(r['wait_mean_ms'])} | {r['wait_p90']} | {r['deferred']:.2f} "
                f"| {' / '.join(str(n) for n in r['per_replica'])} | {errors} |"
            )
        lines += ["", "Each round's TTFT p50 (ms) and loads asked, in the order run:", ""]
        for mode, r in res.items():
            pairs = ", ".join(
                f"{ms(p)} ({n:.0f})" for p, n in zip(r["round_p50"], r["round_loads"], strict=True)
            )
            lines.append(f"- {mode}: {pairs}")
        lines += ["", "Errors the clients saw:", ""]
        for mode, r in res.items():
            lines.append(f"- {mode}: {error_kinds(r['errors'])}")
        lines += ["", "The worker's loads after the warm-up, replayed in order:", ""]
        for mode, r in res.items():
            lines.append(
                f"- {mode}: {r['loads_done']} loads, {r['copies']} of them a further copy of an "
                f"adapter another replica held; {r['unloads_done']} unloads, {r['roomy']} of "
                "them while another replica had a free place; during the warm-up, loads per "
                f"replica {' / '.join(map(str, r['cold_loads']))}, unloads "
                f"{' / '.join(map(str, r['cold_unloads']))}"
            )
        lines += ["", "What each replica held at the end of the last round:", ""]
        for mode, runs in by_mode.items():
            where = "; ".join(", ".join(names) or "nothing" for names in runs[-1]["held_end"])
            lines.append(f"- {mode}: {where}")
        lines.append("")
        lo, ig = res.get("loaded"), res.get("ignore")
        if lo and ig and lo["p50"] and ig["p50"]:
            per_request = (lo["loads_asked"] / max(lo["requests"], 1)) / max(
                ig["loads_asked"] / max(ig["requests"], 1), 1e-9
            )
            verdict.append(
                f"- {slots} kept: loads per request with `loaded` routing "
                f"{per_request:.2f}× those of `ignore` ({lo['loads_asked']:.0f} in "
                f"{lo['requests']} requests vs {ig['loads_asked']:.0f} in {ig['requests']}): "
                f"{'fewer' if per_request < 1 else 'NOT fewer'}"
            )
            verdict.append(
                f"- {slots} kept: TTFT p50 {lo['p50'] / ig['p50']:.2f}×, p90 "
                f"{(lo['p90'] or 0) / (ig['p90'] or 1):.2f}× those of `ignore` "
                f"({ms(lo['p50'])} / {ms(lo['p90'])} ms vs {ms(ig['p50'])} / "
                f"{ms(ig['p90'])} ms)"
            )
    return "\n".join(lines).rstrip() + "\n", verdict


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--write", action="store_true", help="replace the section in RESULTS.md")
    ap.add_argument("--workers", type=int, default=2, help="gunicorn workers of the gateway")
    ap.add_argument("--clients", type=int, default=12, help="concurrent streaming clients")
    ap.add_argument("--seconds", type=float, default=100.0, help="traffic per run")
    ap.add_argument("--warm", type=float, default=15.0, help="first seconds left out")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each mode, interleaved")
    ap.add_argument("--cpu-loras", default="2,4", help="the engines' --max-cpu-loras, each run")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--from-raw", type=Path, help="report an earlier run's raw results")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    dump = Path(tempfile.gettempdir()) / "adapter-routing-raw.json"
    if a.from_raw:
        raw = json.loads(a.from_raw.read_text())
    else:
        started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        before = load_avg()
        base_env = {**os.environ, "TOLLGATE_ENV": "test", "TOLLGATE_LOG_LEVEL": "WARNING"}
        make_template(base_env)
        raw = {"runs": {}}
        modes = a.modes.split(",")
        try:
            for turn in range(a.rounds):
                for cpu in a.cpu_loras.split(","):
                    for mode in modes if turn % 2 == 0 else modes[::-1]:
                        got = run_once(mode, int(cpu), a, base_env)
                        raw["runs"].setdefault(cpu, {}).setdefault(mode, []).append(got)
                        dump.write_text(json.dumps(raw))  # nothing measured is lost
                        brief = {k: v for k, v in got.items() if k != "requests"}
                        print(json.dumps(brief), file=sys.stderr, flush=True)
        finally:
            with contextlib.suppress(subprocess.CalledProcessError):
                psql(f"DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)")
        cmd = "$ .venv/bin/python bench/adapter_routing_bench.py " + " ".join(sys.argv[1:])
        machine = (
            f"`nproc` {os.cpu_count()}, `uname -m` {platform.machine()}, Python "
            f"{platform.python_version()}; {started}; the whole appliance (web `gunicorn -w "
            f"{a.workers}` with production settings, worker, beat, usage consumer); "
            f"{REPLICAS} simulator engines, `--max-num-seqs {SEQS} --max-loras {MAX_LORAS} "
            f"--sim-lora-load-ms {LOAD_MS}`; {a.clients} clients, {a.seconds:g} s a run of "
            f"which the first {a.warm:g} s are left out, {a.rounds} rounds; load average "
            f"before {before}, after {load_avg()}"
        )
        raw["meta"] = {"cmd": cmd.strip(), "machine": machine}
        dump.write_text(json.dumps(raw))
    text, verdict = report(raw["runs"], a)
    cmd, machine = raw["meta"]["cmd"], raw["meta"]["machine"]
    out = f"{cmd}\n{machine}\n\n{text}\n" + "\n".join(verdict)
    print("\n" + out)
    print(f"\nraw results: {dump}", file=sys.stderr)
    if a.write:
        replace_block(
            SECTION,
            BEGIN,
            END,
            f"Latest run: {machine}.\n\n```\n{cmd}\n```\n\n{text}\nComparisons:\n\n"
            + "\n".join(verdict)
            + "\n",
        )


if __name__ == "__main__":
    main()
