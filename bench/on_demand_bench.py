"""Models on demand (issue 30): the cold start as a user meets it, and what a warm on-demand
model costs against an always-running one.

The whole appliance (bench/gateway_appliance.py: web ``gunicorn -w 2`` with production
settings, the worker consuming ``control,demand,nodes`` and the node's queue, beat, the
usage consumer) on a throw-away database (``tollgate_ondemandbench``), Redis prefix and
Celery broker database, drives a real node: the local Docker Engine behind the Docker API
policy (``python -m dockerpolicy`` on a loopback port, as the appliance's ``docker-proxy``;
the node's ``docker_url`` is the policy's, its ``engine_host`` 127.0.0.1, so engines
publish their port on loopback only), with a stack id, engine network and labels of the
run's own. Engine timings are the shipped ones (``TOLLGATE_ENGINE_POLL_SECONDS`` 1 s, the
idle pass every 10 s); images are never pulled (``TOLLGATE_PULL_POLICY=never``).

1. **Cold start on the simulator** (``tollgate/engine-sim:latest``, scripts/build-images).
   ``--sim-load-seconds 30`` (``SIM_LOAD_SECONDS``): nothing listens for 30 s, then the
   engine answers. It stands for a ~8B model on a DGX Spark restarted with warm caches:
   16 GB of bf16 weights read from the page cache or NVMe in a few seconds, vLLM's start-up
   (imports, profiling, CUDA graphs, a cached torch.compile) most of the rest; a tiny model
   loads in seconds and a 100B-class one takes 10–15 min (/work/shared/VLLM_API.md), so
   scale the figure with ``--sim-load-seconds``. Its catalogue row is a 0.6B model (4,096
   tokens, 4 sequences), so that it and the always-running twin of 3 fit this machine's
   memory budget: only the load time stands for the 8B. The ~25 s JIT of a Spark's first
   request is ``--sim-jit-ms`` (``SIM_FIRST_REQUEST_DELAY_MS``, 0 by default): Tollgate's
   own warm-up request pays it before the replica is ready, inside the start. ``--rounds``
   (3) times: with the model unloaded (no container, its card ``unloaded``), one streaming
   chat through the ``openai`` SDK; the time from the call to the first content token, and
   where it went: the gateway asking and the worker deciding (the WAKE operation's
   ``asked``), the WAKE operation waiting on the node's queue, its start phases (pull,
   create, start, load, models, warm-up: the operation's ``detail``), and from the replica's
   ``ready_at`` to the first token (the gateway hearing of it, the engine's prefill); beside
   them the worker's ``tollgate_demand_time_to_ready_seconds`` and the usage record's
   ``start_wait_ms``. After each round the model is left idle: its idle timeout
   (``--idle-seconds`` 10) and beat's idle pass stop it, and the time until its container
   is gone is shown too.
2. **Cold start on the real vLLM CPU engine** (``tollgate/vllm-cpu`` by
   ``scripts/build-images vllm-cpu``; the test model staged by scripts/make-test-model in
   the volume ``tollgate-test-vllm-models``, vLLM's compile cache in
   ``tollgate-test-vllm-compile``: the bench's stack mounts both, as tests/vllm does), the
   ``cpu`` profile with ``VLLM_CPU_KVCACHE_SPACE=1``, the model marked staged:
   ``--vllm-rounds`` (2) of the same measurement (about a minute a start on two cores).
3. **Warm overhead**: the simulator deployment of 1 (on demand, loaded) against an
   ``always`` deployment of the same image, model size, flags and environment on the same
   node, ``--sim-ttft-ms 5`` and no decode delay so the gateway's part is most of what is
   timed; after 20 warm-up requests each, ``--requests`` (200) short non-streaming chats
   each, one at a time, in pairs whose order alternates (on demand first, then always
   first). Client latency p50/p90/mean of each and their ratios, and the median of the
   paired differences with a 95 % bootstrap interval: an interval holding 0 is "no
   measurable difference".

The machine is shared and noisy: compare the two deployments within one run.

    .venv/bin/python bench/on_demand_bench.py            # print the tables
    .venv/bin/python bench/on_demand_bench.py --write    # and replace its RESULTS.md section

Everything it made goes at the end: the appliance's processes, the policy, containers by
the stack's label, its engine network, the cache volumes if it created them, its database,
its Redis keys and broker database.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import docker
import httpx
import openai
import redis
from gateway_appliance import Appliance, start_appliance
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

DB_NAME = "tollgate_ondemandbench"
SECTION = "## Models on demand: cold start and warm overhead (issue 30)"
BEGIN, END = (
    "<!-- on_demand_bench.py --write: begin -->",
    "<!-- on_demand_bench.py --write: end -->",
)
SIM_IMAGE = "tollgate/engine-sim:latest"
VLLM_IMAGE = "tollgate/vllm-cpu:0.32.0"  # deployments/profiles.py's cpu profile
MODEL_VOLUME = os.environ.get("VLLM_TEST_MODELS", "tollgate-test-vllm-models")
COMPILE_VOLUME = os.environ.get("VLLM_TEST_COMPILE", "tollgate-test-vllm-compile")
SIM_ON_DEMAND, SIM_ALWAYS, VLLM_ON_DEMAND = "sim-on-demand", "sim-always", "tiny-on-demand"
SIM_ARGS = {"max-num-seqs": 4, "max-model-len": 4096}
VLLM_CONTEXT = 2048
START_TIMEOUT = 900  # seconds a cold request may wait (vLLM on a loaded 2-core box: minutes)
WARMUP_REQUESTS = 20
PHASES = ("pull", "create", "start", "load", "models", "warmup")
LABEL_STACK, LABEL_DEPLOYMENT = "tollgate.stack", "tollgate.deployment"  # deployments/runtime.py

SETUP = """
from decimal import Decimal
from django.utils import timezone
from deployments import services as ds
from deployments.models import EngineProfile, StagedModel
from deployments.profiles import ensure_builtin_profiles
from metering import services as ms
from tenants import services as ts
ensure_builtin_profiles()
node = ds.register_node(None, name=P["node"], docker_url=P["docker_url"],
    engine_host="127.0.0.1", queue=P["queue"], total_memory_bytes=P["memory"])
none = {"requests_per_minute": None, "tokens_per_minute": None, "max_concurrent_requests": None}
tenant = ts.create_tenant(None, name="Bench", slug="bench", quota_tokens=None, **none)
key = ts.issue_api_key(None, tenant, name="bench", **none).plaintext
def model(name, source, billions, context):
    m = ds.create_model(None, served_name=name, source=source,
        params_billions=Decimal(billions), context_length=context)
    ms.set_price(None, m, Decimal("1"), Decimal("0.5"), Decimal("2"))
    return m
ids = {}
sim = model(P["sim"], "bench/sim-model", "0.6", 4096)
model(P["always"], "bench/sim-model", "0.6", 4096)  # its deployment comes before the warm phase
ids["sim"] = ds.create_deployment(None, name=P["sim"], model=sim, node=node,
    image=P["image"], env=P["sim_env"], engine_args=P["args"], mode="on_demand",
    idle_timeout_seconds=P["idle"], start_timeout_seconds=P["start_timeout"]).pk
if P["vllm"]:
    tiny = model(P["vllm"], "tollgate-test/tiny-llama", "0.01", P["context"])
    # scripts/make-test-model put it in the cache volume: staged, so HF_HUB_OFFLINE=1.
    StagedModel.objects.update_or_create(model=tiny, node=node,
        defaults={"size_bytes": 0, "staged_at": timezone.now()})
    ids["vllm"] = ds.create_deployment(None, name=P["vllm"], model=tiny, node=node,
        profile=EngineProfile.objects.get(name="cpu"),
        engine_args={"max-model-len": P["context"]}, env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        mode="on_demand", idle_timeout_seconds=P["idle"],
        start_timeout_seconds=P["start_timeout"]).pk
print(json.dumps({"key": key, "ids": ids}))
"""

ALWAYS = """
from deployments import services as ds
from deployments.models import CatalogModel, Node
dep = ds.create_deployment(None, name=P["name"], model=CatalogModel.objects.get(
    served_name=P["name"]), node=Node.objects.get(name=P["node"]), image=P["image"],
    env=P["sim_env"], engine_args=P["args"], mode="always")
print(json.dumps(dep.pk))
"""

STOP = """
from deployments import services as ds
from deployments.models import Deployment
ds.set_desired_state(None, Deployment.objects.get(pk=P["id"]), "stopped")
print(json.dumps(True))
"""

# What the round left in the database: the start's WAKE operation, the replica's ready time,
# and the request's usage record (once the usage consumer has stored it).
FACTS = """
import time
from deployments.models import Operation, Replica
from metering.models import UsageEvent
def stamp(d):
    return d.timestamp() if d else None
found = UsageEvent.objects.none()
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    found = UsageEvent.objects.filter(deployment_id=P["id"])
    found = found.filter(request_id=P["rid"]) if P["rid"] else found.order_by("-occurred_at")
    if found.exists():
        break
    time.sleep(0.5)
ev = found.first()
op = Operation.objects.filter(kind="wake", deployment_id=P["id"]).order_by("-id").first()
rep = Replica.objects.filter(deployment_id=P["id"]).order_by("index").first()
print(json.dumps({
    "op": op and {"status": op.status, "asked": op.detail.get("asked"),
        "created": stamp(op.created_at), "claimed": stamp(op.started_at),
        "finished": stamp(op.finished_at), "error": op.error[:300],
        "phases": (op.detail.get("replicas") or {}).get("0", {}).get("phases", {})},
    "ready_at": stamp(rep.ready_at) if rep else None,
    "event": ev and {"start_wait_ms": ev.start_wait_ms, "ttft_ms": ev.ttft_ms,
        "latency_ms": ev.latency_ms, "status": ev.status},
}))
"""


# --- the stack -------------------------------------------------------------------------------


def django(code: str, env: dict, **params: Any) -> Any:
    """Run ``code`` in ``manage.py shell`` with ``P`` = ``params``; its last line, as JSON."""
    script = f"import json\nP = json.loads({json.dumps(json.dumps(params))})\n{code}"
    out = sh([PY, "manage.py", "shell", "-c", script], cwd=ROOT, env=env)
    return json.loads(out.strip().splitlines()[-1])


def query(sql: str) -> str:
    return sh(["psql", f"{PG}/{DB_NAME}", "-At", "-c", sql]).strip()


def meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def start_policy(env: dict, tmp: Path) -> tuple[str, Server]:
    """The Docker API policy for the stack in front of the Docker socket (its tcp:// URL)."""
    host = os.environ.get("DOCKER_HOST", "")
    sock = host.removeprefix("unix://") if host.startswith("unix://") else "/var/run/docker.sock"
    port = free_port()
    log = open(tmp / "dockerpolicy.log", "a")  # noqa: SIM115 - the process's
    proc = subprocess.Popen(
        [PY, "-m", "dockerpolicy", "--listen", f"127.0.0.1:{port}", "--docker-socket", sock],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    wait_listening(port, proc, timeout=30)
    return f"tcp://127.0.0.1:{port}", Server(proc)


def stack_env(stack: str, prefix: str, tmp: Path) -> dict:
    """The environment the appliance's processes and the policy share (before the
    appliance's production settings are laid over it)."""
    return {
        **os.environ,
        "TOLLGATE_ENV": "test",
        "TOLLGATE_LOG_LEVEL": "WARNING",
        "DATABASE_URL": f"{PG}/{DB_NAME}",
        "TOLLGATE_REDIS_PREFIX": prefix,
        "TOLLGATE_METRICS_TOKEN": secrets.token_urlsafe(16),
        "PROMETHEUS_MULTIPROC_DIR": str(tmp / "prom"),
        "TOLLGATE_STACK_ID": stack,
        "TOLLGATE_ENGINE_NETWORK": f"{stack}-net",
        "TOLLGATE_MODEL_CACHE_VOLUME": MODEL_VOLUME,
        "TOLLGATE_COMPILE_CACHE_VOLUME": COMPILE_VOLUME,
        "TOLLGATE_ENGINE_IMAGES": "tollgate/engine-sim:*,tollgate/vllm-cpu:*",
        "TOLLGATE_PULL_POLICY": "never",
    }


def sim_env(a: argparse.Namespace) -> dict[str, str]:
    """The simulator's knobs, through the engine environment an admin may set."""
    return {
        "SIM_LOAD_SECONDS": f"{a.sim_load_seconds:g}",
        "SIM_FIRST_REQUEST_DELAY_MS": f"{a.sim_jit_ms:g}",
        "SIM_TTFT_MS": f"{a.sim_ttft_ms:g}",
        "SIM_TTFT_PER_TOKEN_MS": "0",
        "SIM_DECODE_TPS": "0",
    }


def clean_docker(stack: str, made_volumes: list[str]) -> None:
    """Containers by the stack's label, its engine network, the volumes it created."""
    client = docker.from_env()
    for container in client.containers.list(
        all=True, filters={"label": f"{LABEL_STACK}={stack}"}, ignore_removed=True
    ):
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True)
    for network in client.networks.list(names=[f"{stack}-net"]):
        with contextlib.suppress(docker.errors.NotFound):
            network.remove()
    for name in made_volumes:
        with contextlib.suppress(docker.errors.NotFound):
            client.volumes.get(name).remove(force=True)


def clean_redis(prefix: str) -> None:
    r = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    keys = list(r.scan_iter(f"{prefix}:*", count=1000))
    for i in range(0, len(keys), 500):
        r.delete(*keys[i : i + 500])


# --- talking to it ---------------------------------------------------------------------------


class Bench:
    """The running stack: the gateway's URL, the key, the deployments, the environment."""

    def __init__(
        self, url: str, key: str, ids: dict, env: dict, node: str, appliance: Appliance
    ) -> None:
        self.url, self.key, self.ids, self.node, self.appliance = url, key, ids, node, appliance
        db = appliance.broker.connection_pool.connection_kwargs["db"]
        # Rows made from here queue their tasks where the appliance's worker takes them.
        self.env = {**env, "CELERY_BROKER_URL": f"redis://127.0.0.1:6379/{db}"}
        self.stack = env["TOLLGATE_STACK_ID"]
        self.docker = docker.from_env()
        self.http = httpx.Client(
            base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=START_TIMEOUT
        )

    def card_state(self, name: str) -> str:
        card = self.http.get(f"/v1/models/{name}", timeout=10).json()
        return (card.get("tollgate") or {}).get("state", "")

    def engines(self, deployment_id: int) -> list:
        labels = [f"{LABEL_STACK}={self.stack}", f"{LABEL_DEPLOYMENT}={deployment_id}"]
        return self.docker.containers.list(all=True, filters={"label": labels})

    def wait_cold(self, deployment_id: int, name: str, timeout: float = 300.0) -> float:
        """Seconds until the deployment has no container and its card says ``unloaded``."""
        started = time.monotonic()
        while self.engines(deployment_id) or self.card_state(name) != "unloaded":
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"{name} was not unloaded within {timeout:.0f} s")
            self.alive()
            time.sleep(0.5)
        return time.monotonic() - started

    def alive(self) -> None:
        for name, part in self.appliance.parts.items():
            if part.proc.poll() is not None:
                raise RuntimeError(f"the appliance's {name} exited")

    def metrics(self, name: str) -> dict[str, float]:
        """The gateway's on-demand figures for one model."""
        from prometheus_client.parser import text_string_to_metric_families

        token = self.env["TOLLGATE_METRICS_TOKEN"]
        text = httpx.get(
            f"{self.url}/metrics", headers={"authorization": f"Bearer {token}"}, timeout=10
        ).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("tollgate_demand_") and s.labels.get("model") == name:
                    out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def chat(self, name: str, max_tokens: int) -> float:
        """One short non-streaming chat; its client latency in ms (raises on an error)."""
        body = {
            "model": name,
            "messages": [{"role": "user", "content": "Say hello in a few words."}],
            "max_tokens": max_tokens,
        }
        started = time.perf_counter()
        reply = self.http.post("/v1/chat/completions", json=body)
        took = (time.perf_counter() - started) * 1000
        if reply.status_code != 200:
            raise RuntimeError(f"{name}: {reply.status_code} {reply.text[:300]}")
        return took


# --- 1 and 2: the cold start -----------------------------------------------------------------


def first_token(b: Bench, name: str, max_tokens: int) -> dict:
    """A streaming chat through the openai SDK: when it was sent (epoch), seconds to the
    first content token and to the end, its request id, what went wrong."""
    client = openai.OpenAI(base_url=f"{b.url}/v1", api_key=b.key, max_retries=0)
    sent, t0 = time.time(), time.perf_counter()
    out: dict[str, Any] = {"sent": sent, "first": None, "done": None, "rid": "", "error": ""}
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=name,
            messages=[{"role": "user", "content": "Tell me about the sea."}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
            timeout=START_TIMEOUT + 60,
        )
        out["rid"] = raw.headers.get("x-request-id", "")
        for chunk in raw.parse():
            for choice in chunk.choices:
                if choice.delta.content and out["first"] is None:
                    out["first"] = time.perf_counter() - t0
        out["done"] = time.perf_counter() - t0
    except openai.APIError as exc:
        out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return out


def cold_round(b: Bench, key: str, name: str, max_tokens: int) -> dict:
    """One cold start: unloaded, then the first request; what it took and where it went."""
    deployment_id = b.ids[key]
    b.wait_cold(deployment_id, name)
    before = b.metrics(name)
    got = first_token(b, name, max_tokens)
    ended = time.monotonic()
    # Read while the replica is up (stopping it clears its ready time).
    facts = django(FACTS, b.env, id=deployment_id, rid=got["rid"])
    after = b.metrics(name)
    unloaded_after = None
    if not got["error"]:
        b.wait_cold(deployment_id, name)
        unloaded_after = time.monotonic() - ended
    ready_count = delta(after, before, "tollgate_demand_time_to_ready_seconds_count")
    ready_sum = delta(after, before, "tollgate_demand_time_to_ready_seconds_sum")
    return {
        **got,
        **facts,
        "unloaded_after": unloaded_after,
        "starts_asked": delta(after, before, "tollgate_demand_starts_requested_total"),
        "time_to_ready": ready_sum / ready_count if ready_count else None,
        "gateway_wait": delta(after, before, "tollgate_demand_wait_seconds_sum"),
    }


def delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def cold_rounds(b: Bench, key: str, name: str, rounds: int, max_tokens: int) -> list[dict]:
    runs = []
    for i in range(rounds):
        print(f"{name}: cold start {i + 1} of {rounds} …", file=sys.stderr, flush=True)
        run = cold_round(b, key, name, max_tokens)
        print(json.dumps(brief(run)), file=sys.stderr, flush=True)
        runs.append(run)
    return runs


def brief(run: dict) -> dict:
    return {k: run.get(k) for k in ("first", "done", "error", "time_to_ready", "unloaded_after")}


# --- 3: warm overhead ------------------------------------------------------------------------


def warm_compare(b: Bench, a: argparse.Namespace) -> dict:
    """The on-demand deployment (loaded) and an always-running twin, interleaved."""
    b.ids["always"] = django(
        ALWAYS,
        b.env,
        name=SIM_ALWAYS,
        node=b.node,
        image=SIM_IMAGE,
        sim_env=sim_env(a),
        args=SIM_ARGS,
    )
    print("warm: starting the always-running twin …", file=sys.stderr, flush=True)
    wait_answering(b, SIM_ALWAYS, a.sim_load_seconds + 300)
    print("warm: loading the on-demand model …", file=sys.stderr, flush=True)
    wait_answering(b, SIM_ON_DEMAND, START_TIMEOUT)
    for _ in range(WARMUP_REQUESTS):
        b.chat(SIM_ON_DEMAND, 8)
        b.chat(SIM_ALWAYS, 8)
    od_state = b.card_state(SIM_ON_DEMAND)
    times: dict[str, list[float]] = {"on_demand": [], "always": []}
    errors: dict[str, list[str]] = {"on_demand": [], "always": []}
    print(f"warm: {a.requests} requests each, interleaved …", file=sys.stderr, flush=True)
    for i in range(a.requests):
        pair = [("on_demand", SIM_ON_DEMAND), ("always", SIM_ALWAYS)]
        for label, name in pair if i % 2 == 0 else pair[::-1]:
            try:
                times[label].append(b.chat(name, 8))
            except (RuntimeError, httpx.HTTPError) as exc:
                times[label].append(float("nan"))
                errors[label].append(str(exc)[:200])
    sql = "SELECT count(*) FROM deployments_operation WHERE kind = 'wake' AND deployment_id = %d"
    wakes = int(query(sql % int(b.ids["sim"])))
    return {"times": times, "errors": errors, "state_before": od_state, "wakes_total": wakes}


def wait_answering(b: Bench, name: str, timeout: float) -> None:
    """Until a chat to ``name`` answers 200 (a cold on-demand model is woken by it)."""
    deadline = time.monotonic() + timeout
    while True:
        b.alive()
        try:
            b.chat(name, 4)
            return
        except (RuntimeError, httpx.HTTPError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def stop_sim(b: Bench) -> None:
    """The simulators out of the way of the vLLM rounds: the twin stopped, the on-demand
    one left to go idle."""
    if "always" in b.ids:
        django(STOP, b.env, id=b.ids["always"])
    deadline = time.monotonic() + 300
    while b.engines(b.ids["sim"]) or ("always" in b.ids and b.engines(b.ids["always"])):
        if time.monotonic() > deadline:
            raise TimeoutError("the simulator engines were not stopped within 300 s")
        time.sleep(1.0)


# --- the report ------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(v for v in values if v == v)  # NaN (an error) left out
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def median(values: list[float]) -> float | None:
    ok = [v for v in values if v == v]
    return statistics.median(ok) if ok else None


def secs(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


def ms(v: float | None) -> str:
    return "—" if v is None else f"{v:,.1f}"


def breakdown(run: dict) -> dict[str, float | None]:
    """Where the cold request's seconds went, from the client's send (epoch seconds)."""
    op, sent = run.get("op") or {}, run["sent"]
    phases = op.get("phases") or {}
    first = run.get("first")
    asked, claimed, ready = op.get("asked"), op.get("claimed"), run.get("ready_at")
    parts: dict[str, float | None] = {
        "decided": asked - sent if asked else None,
        "claimed": claimed - asked if claimed and asked else None,
        **{p: phases.get(p) for p in PHASES},
        "to_token": (sent + first - ready) if first is not None and ready else None,
    }
    known = sum(v for v in parts.values() if v is not None)
    parts["other"] = first - known if first is not None else None
    wait_ms = (run.get("event") or {}).get("start_wait_ms")
    parts["usage_wait"] = wait_ms / 1000 if wait_ms is not None else None
    return parts


COLD_HEAD = (
    "| round | first token, s | reply done, s | request → decision | WAKE queued | pull | "
    "create | start | load | models | warm-up | ready → first token | rest | worker's "
    "time to ready | waited (usage record) | unloaded after, s |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)
COLD_COLS = ("decided", "claimed", *PHASES, "to_token", "other")


def cold_table(runs: list[dict]) -> str:
    if not runs:
        return "(no rounds)"
    lines = [COLD_HEAD]
    rows: list[list[float | None]] = []
    for i, run in enumerate(runs, 1):
        parts = breakdown(run)
        row = [
            run.get("first"),
            run.get("done"),
            *(parts[c] for c in COLD_COLS),
            run.get("time_to_ready"),
            parts["usage_wait"],
            run.get("unloaded_after"),
        ]
        rows.append(row)
        error = f" ({run['error']})" if run.get("error") else ""
        lines.append(f"| {i}{error} | " + " | ".join(secs(v, 2) for v in row) + " |")
    medians = [median([r[j] for r in rows if r[j] is not None]) for j in range(len(rows[0]))]
    lines.append("| **median** | " + " | ".join(f"**{secs(v, 2)}**" for v in medians) + " |")
    return "\n".join(lines)


def bootstrap(diffs: list[float], n: int = 2000) -> tuple[float, float]:
    """A 95 % interval of the median of ``diffs`` (resampled with replacement)."""
    rng = random.Random(30)
    meds = sorted(median([rng.choice(diffs) for _ in diffs]) or 0.0 for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def warm_report(warm: dict) -> tuple[str, list[str]]:
    od, al = warm["times"]["on_demand"], warm["times"]["always"]
    lines = [
        "| deployment | requests (errors) | p50, ms | p90, ms | mean, ms |",
        "|---|---:|---:|---:|---:|",
    ]
    stats = {}
    for label, values in (("on demand (loaded)", od), ("always", al)):
        ok = [v for v in values if v == v]
        key = "on_demand" if label.startswith("on") else "always"
        stats[key] = (percentile(ok, 0.5), percentile(ok, 0.9), sum(ok) / len(ok) if ok else None)
        p50, p90, mean = stats[key]
        lines.append(
            f"| {label} | {len(values)} ({len(warm['errors'][key])}) | {ms(p50)} | {ms(p90)} "
            f"| {ms(mean)} |"
        )
    diffs = [x - y for x, y in zip(od, al, strict=True) if x == x and y == y]
    verdict = []
    (o50, o90, omean), (a50, a90, amean) = stats["on_demand"], stats["always"]
    if diffs and o50 and a50 and o90 and a90:
        lo, hi = bootstrap(diffs)
        d = median(diffs) or 0.0
        measurable = not (lo <= 0 <= hi)
        verdict = [
            f"- warm on demand / always: p50 {o50 / a50:.3f}×, p90 {o90 / a90:.3f}×, mean "
            f"{(omean or 0) / (amean or 1):.3f}× ({ms(o50)} / {ms(o90)} ms vs {ms(a50)} / "
            f"{ms(a90)} ms)",
            f"- median of the {len(diffs)} paired differences (on demand − always): {d:+.2f} ms, "
            f"95 % bootstrap interval [{lo:+.2f}, {hi:+.2f}] ms: "
            + (
                "a measurable difference" if measurable else "no measurable difference (target met)"
            ),
        ]
    lines.append("")
    lines.append(
        f"The on-demand model's card said `{warm['state_before']}` when the timed requests "
        f"began; it was started {warm['wakes_total']} time(s) in the whole run (the cold "
        "rounds, and once before the warm phase)."
    )
    return "\n".join(lines), verdict


def cold_verdicts(name: str, runs: list[dict]) -> list[str]:
    answered = [r for r in runs if r.get("first") is not None]
    if not answered:
        return [f"- {name}: no cold request got a first token"]
    firsts = [r["first"] for r in answered]
    ready = [r["time_to_ready"] for r in answered if r.get("time_to_ready") is not None]
    loads = [breakdown(r)["load"] or 0.0 for r in answered]
    overhead = [first - load for first, load in zip(firsts, loads, strict=True)]
    return [
        f"- {name}: first token {secs(median(firsts))} s after the first request (median of "
        f"{len(firsts)}; {', '.join(secs(f) for f in firsts)}), of which the engine's own "
        f"load {secs(median(loads))} s; everything else (Tollgate's decision and queue, "
        f"container create and start, the /v1/models check, warm-up, routing) "
        f"{secs(median(overhead))} s; worker's time to ready {secs(median(ready))} s"
    ]


def report(raw: dict) -> tuple[str, list[str]]:
    text: list[str] = []
    verdict: list[str] = []
    meta = raw["meta"]
    text += [
        f"### Cold start on the simulator (`SIM_LOAD_SECONDS={meta['sim_load']:g}`, "
        f"`SIM_FIRST_REQUEST_DELAY_MS={meta['sim_jit']:g}`), seconds",
        "",
        cold_table(raw["sim"]),
        "",
    ]
    verdict += cold_verdicts("simulator", raw["sim"])
    if raw.get("vllm"):
        text += [
            "### Cold start on the real vLLM CPU engine (the test model, `cpu` profile), seconds",
            "",
            cold_table(raw["vllm"]),
            "",
        ]
        verdict += cold_verdicts("vLLM CPU", raw["vllm"])
    if raw.get("warm"):
        table, lines = warm_report(raw["warm"])
        text += [
            f"### Warm: on demand (loaded) against always running, "
            f"`SIM_TTFT_MS={meta['sim_ttft']:g}`, client latency",
            "",
            table,
            "",
        ]
        verdict += lines
    text.append(
        "Columns: *request → decision* is the gateway asking on the demand queue and the "
        "worker fitting the model in the node's budget (the WAKE operation's `asked`); *WAKE "
        "queued* its wait on the node's queue until a worker took it; *pull … warm-up* the "
        "start's phases as the operation records them (*load* is the engine loading until it "
        "listens); *ready → first token* from the replica's `ready_at` to the client's first "
        "token (the gateway hearing of the ready replica, the engine's prefill); *rest* what "
        "none of these account for; *worker's time to ready* "
        "`tollgate_demand_time_to_ready_seconds` (decision to ready); *waited* the usage "
        "record's `start_wait_ms`; *unloaded after* from the reply's end until the container "
        "was gone (the idle timeout, beat's 10-s idle pass, the drain and stop)."
    )
    return "\n".join(text) + "\n", verdict


# --- main ------------------------------------------------------------------------------------


def run(a: argparse.Namespace, dump: Path) -> dict:
    """Start everything, measure, tear everything down; the raw results (also written to
    ``dump`` after each part, so nothing measured is lost)."""
    stack = f"tgbench-{secrets.token_hex(4)}"
    prefix = f"ondemandbench-{secrets.token_hex(4)}"
    tmp = Path(tempfile.mkdtemp(prefix="ondemandbench-"))
    (tmp / "prom").mkdir()
    env = stack_env(stack, prefix, tmp)
    client = docker.from_env()
    existing = {v.name for v in client.volumes.list()}
    made = [v for v in (MODEL_VOLUME, COMPILE_VOLUME) if v not in existing]
    servers: list = []
    failed = True
    raw: dict = {"sim": [], "vllm": [], "warm": None}
    try:
        policy_url, policy = start_policy(env, tmp)
        servers.append(policy)
        env = {**env, "TOLLGATE_DOCKER_URL": policy_url}
        node = f"bench-{stack[-8:]}"
        psql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        psql(f"CREATE DATABASE {DB_NAME}")
        print("migrating a fresh database …", file=sys.stderr, flush=True)
        sh([PY, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=env)
        queue = f"node.{node}"
        rows = django(
            SETUP,
            env,
            node=node,
            docker_url=policy_url,
            queue=queue,
            memory=meminfo("MemTotal"),
            sim=SIM_ON_DEMAND,
            always=SIM_ALWAYS,
            vllm=VLLM_ON_DEMAND if not a.skip_vllm else "",
            context=VLLM_CONTEXT,
            image=SIM_IMAGE,
            sim_env=sim_env(a),
            args=SIM_ARGS,
            idle=a.idle_seconds,
            start_timeout=START_TIMEOUT,
        )
        models = {SIM_ON_DEMAND} | ({VLLM_ON_DEMAND} if not a.skip_vllm else set())
        url, appliance = start_appliance(
            a.workers,
            env,
            rows["key"],
            tmp,
            frozenset(models),
            queues=f"control,demand,nodes,{queue}",
        )
        servers.append(appliance)
        b = Bench(url, rows["key"], rows["ids"], env, node, appliance)
        wait_heartbeat(b)
        raw["sim"] = cold_rounds(b, "sim", SIM_ON_DEMAND, a.rounds, 8)
        dump.write_text(json.dumps(raw))
        if a.requests:
            raw["warm"] = warm_compare(b, a)
            dump.write_text(json.dumps(raw))
        if not a.skip_vllm:
            stop_sim(b)
            raw["vllm"] = cold_rounds(b, "vllm", VLLM_ON_DEMAND, a.vllm_rounds, 16)
        raw["policy_refusals"] = [
            line
            for line in (tmp / "dockerpolicy.log").read_text(errors="replace").splitlines()
            if " refused " in line
        ]
        failed = False
    finally:
        for srv in reversed(servers):
            with contextlib.suppress(Exception):
                srv.stop()
        with contextlib.suppress(Exception):
            clean_docker(stack, made)
        with contextlib.suppress(subprocess.CalledProcessError):
            psql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        with contextlib.suppress(Exception):
            clean_redis(prefix)
        if failed:
            print(f"logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return raw


def wait_heartbeat(b: Bench, timeout: float = 90.0) -> None:
    """Until the node's worker has reported the node (beat's reconcile, every 5 s)."""
    deadline = time.monotonic() + timeout
    sql = f"SELECT last_seen_at IS NOT NULL FROM deployments_node WHERE name = '{b.node}'"
    while query(sql) != "t":
        if time.monotonic() > deadline:
            raise TimeoutError(f"node {b.node}'s worker sent no heartbeat in {timeout:.0f} s")
        b.alive()
        time.sleep(0.5)


def preflight(a: argparse.Namespace) -> None:
    client = docker.from_env()
    images = [SIM_IMAGE] + ([] if a.skip_vllm else [VLLM_IMAGE])
    for image in images:
        try:
            client.images.get(image)
        except docker.errors.ImageNotFound:
            sys.exit(f"{image} is not on this Docker Engine: build it with scripts/build-images")
    if not a.skip_vllm:
        names = {v.name for v in client.volumes.list()}
        if MODEL_VOLUME not in names:
            sys.exit(
                f"the volume {MODEL_VOLUME} does not exist: stage the test model with "
                "scripts/make-test-model (or run with --skip-vllm)"
            )


def machine(a: argparse.Namespace, started: str, before: str) -> str:
    return (
        f"`nproc` {os.cpu_count()}, {meminfo('MemTotal') / 2**30:.1f} GiB memory, "
        f"{cpu_model()} (`uname -m` {platform.machine()}); {started} (`date -u`); the whole "
        f"appliance (web `gunicorn -w {a.workers}` with production settings, worker on "
        "`control,demand,nodes,node.<node>`, beat, usage consumer) and the local Docker "
        f"Engine behind the Docker API policy; load average before {before}, after "
        f"{load_avg()}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--write", action="store_true", help="replace the section in RESULTS.md")
    ap.add_argument("--workers", type=int, default=2, help="gunicorn workers of the gateway")
    ap.add_argument("--rounds", type=int, default=3, help="cold starts on the simulator")
    ap.add_argument("--vllm-rounds", type=int, default=2, help="cold starts on vLLM CPU")
    ap.add_argument("--skip-vllm", action="store_true", help="no vLLM rounds")
    ap.add_argument("--sim-load-seconds", type=float, default=30.0, help="SIM_LOAD_SECONDS")
    ap.add_argument(
        "--sim-jit-ms", type=float, default=0.0, help="SIM_FIRST_REQUEST_DELAY_MS (JIT)"
    )
    ap.add_argument("--sim-ttft-ms", type=float, default=5.0, help="SIM_TTFT_MS")
    ap.add_argument("--requests", type=int, default=200, help="warm requests per deployment")
    ap.add_argument("--idle-seconds", type=int, default=10, help="the idle timeout (>= 10)")
    ap.add_argument("--from-raw", type=Path, help="report an earlier run's raw results")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    dump = Path(tempfile.gettempdir()) / "on-demand-raw.json"
    if a.from_raw:
        raw = json.loads(a.from_raw.read_text())
    else:
        preflight(a)
        started = sh(["date", "-u"]).strip()
        before = load_avg()
        raw = run(a, dump)
        cmd = "$ .venv/bin/python bench/on_demand_bench.py " + " ".join(sys.argv[1:])
        raw["meta"] = {
            "cmd": cmd.strip(),
            "machine": machine(a, started, before),
            "sim_load": a.sim_load_seconds,
            "sim_jit": a.sim_jit_ms,
            "sim_ttft": a.sim_ttft_ms,
        }
        dump.write_text(json.dumps(raw))
    text, verdict = report(raw)
    refusals = raw.get("policy_refusals") or []
    verdict.append(f"- Docker API policy refusals of Tollgate's own calls: {len(refusals)}")
    meta = raw["meta"]
    out = f"{meta['cmd']}\n{meta['machine']}\n\n{text}\n" + "\n".join(verdict)
    print("\n" + out)
    if not a.from_raw:
        print(f"\nraw results: {dump}", file=sys.stderr)
    if a.write:
        replace_block(
            SECTION,
            BEGIN,
            END,
            f"Latest run: {meta['machine']}.\n\n```\n{meta['cmd']}\n```\n\n{text}\n"
            "Comparisons:\n\n" + "\n".join(verdict) + "\n",
        )


if __name__ == "__main__":
    main()
