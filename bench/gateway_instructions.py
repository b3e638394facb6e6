"""Instructions per /v1 request in the gateway process, counted by callgrind: one source tree
against another, repeatably on a loaded machine.

Wall-clock CPU per request moves by ±30 % on this shared 2-core machine; the number of
instructions the gateway executes for a request does not. For each ``--tree LABEL=PATH``
(a checkout with its own ``.venv``) this runs the tree's real ASGI application
(``config.asgi:application``: lifespan start-up, the Redis pools, the snapshot cache, the
upstream client production uses) inside ONE Python process under
``valgrind --tool=callgrind``, and drives it in-process with raw ASGI calls (what uvicorn
hands the app, without uvicorn's HTTP parsing or a load generator's work). Real Redis
(its own key prefix), real PostgreSQL (a throw-away database ``bench_i17_<label>``, built by
the tree's own migrations and services), real simulator engines outside valgrind.

Per scenario: a few warm requests, then callgrind's counters are zeroed, N requests are
served one after another and the Prometheus flush they owe is run, and the counters are
dumped (valgrind client requests, from a ten-line C helper compiled on the fly and loaded
with ctypes). Instructions per request = that dump's total / N. The gateway's timers
(snapshot reload, lease renewal, telemetry, last-used flush) are stopped after warm-up:
they run per second, not per request, and under valgrind's slowdown they would land in
the windows by chance.

    .venv/bin/python bench/gateway_instructions.py \\
        --tree before-17=/tmp/i17-before --tree after-17=/tmp/i17-after --tree main=. \\
        --repeat 2 --base before-17

Scenarios: chat (16 tokens, no delay), completions, embeddings, chat streamed (16 and 64
tokens, 10 ms apart: per request and per extra chunk), a 429 (a key limited to one request
a minute), a 401 (a wrong secret for a real key prefix), a 404 (unknown model), and on
trees that serve them /v1/responses (kept, as the SDK's default) and /v1/messages.
``--keep DIR`` keeps the callgrind files for ``callgrind_annotate --inclusive=yes``;
``--bytecodes`` (no valgrind) lists, per scenario, the Python functions whose bytecodes per
request differ from ``--base``'s: where a tree's extra instructions are. Results and method:
bench/RESULTS.md, "Issue 17".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime
import json
import os
import platform
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

ROOT = Path(__file__).resolve().parents[1]
PG = "postgres://postgres@127.0.0.1:5432"
HIGH = 1_000_000_000  # requests or tokens per minute: never reached
# name -> (tokens per reply, decode tokens/s; 0 = no delay, runner)
SIMS = {
    "bench-model": (16, 0, "generate"),
    "bench-stream": (64, 100, "generate"),  # 10 ms apart: one frame per read, 0.64 s a reply
    "bench-embed": (16, 0, "pooling"),
}
TASKS = {"bench-model": "generate", "bench-stream": "generate", "bench-embed": "embed"}
HELPER_C = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void cg_zero(void) { CALLGRIND_ZERO_STATS; }
void cg_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
"""


# --- in the tree's own environment: the rows ---------------------------------------------------


def setup_rows(ports: dict[str, int]) -> dict[str, str]:
    """Node, tenant, models with prices and a ready replica each, a key and a limited key."""
    import django

    django.setup()
    from deployments import services as deployment_services
    from deployments.models import Deployment, Replica
    from metering import services as metering_services
    from tenants import services as tenant_services

    node = deployment_services.register_node(
        None, name="bench-node", docker_url="unix:///x", engine_host="127.0.0.1"
    )
    tenant = tenant_services.create_tenant(
        None,
        name="Bench",
        slug="bench",
        requests_per_minute=HIGH,
        tokens_per_minute=HIGH,
        max_concurrent_requests=100_000,
        quota_tokens=10**15,
    )
    for name, port in ports.items():
        model = deployment_services.create_model(
            None,
            served_name=name,
            source=f"sim/{name}",
            task=TASKS[name],
            params_billions=_dec("1"),
            context_length=4096,
            visibility="public",
        )
        metering_services.set_price(None, model, *(_dec(v) for v in ("1.00", "0.50", "2.00")))
        deployment = Deployment.objects.create(
            name=f"{name}-dep",
            model=model,
            node=node,
            image="tollgate/engine-sim:latest",
            engine_args={"max-num-seqs": 4096},
            desired_state="running",
            state="ready",
        )
        Replica.objects.create(
            deployment=deployment,
            index=0,
            node=node,
            host="127.0.0.1",
            port=port,
            state="ready",
            healthy=True,
        )
    limits = {"tokens_per_minute": HIGH, "max_concurrent_requests": 100_000}
    key = tenant_services.issue_api_key(
        None, tenant, name="bench", requests_per_minute=HIGH, **limits
    )
    limited = tenant_services.issue_api_key(
        None, tenant, name="limited", requests_per_minute=1, **limits
    )
    return {"key": key.plaintext, "limited": limited.plaintext}


def _dec(value: str) -> Any:
    from decimal import Decimal

    return Decimal(value)


# --- in the tree's own environment, under callgrind: the requests --------------------------------


def request_body(api: str, model: str, tokens: int, stream: bool) -> bytes:
    """What bench/gateway_load.py (and the SDKs) send."""
    import orjson

    if api == "responses":
        payload = {"model": model, "input": "Say something.", "max_output_tokens": tokens}
        return orjson.dumps({**payload, "stream": stream})
    if api == "completions":
        payload = {"model": model, "prompt": "Say something.", "max_tokens": tokens}
        return orjson.dumps({**payload, "stream": stream})
    if api == "embeddings":
        return orjson.dumps({"model": model, "input": "Say something."})
    payload = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": tokens,
        "stream": stream,
    }
    if api == "chat":
        payload["ignore_eos"] = True
        if stream:
            payload["stream_options"] = {"include_usage": True}
    return orjson.dumps(payload)


PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}


def scenarios(keys: dict[str, str]) -> list[dict]:
    """The scenarios; a tree runs those whose path it serves."""
    key, limited = keys["key"], keys["limited"]
    wrong = key[:-4] + ("aaaa" if not key.endswith("aaaa") else "bbbb")  # a real prefix
    rows = [  # name, api, model, max tokens, stream, key, the status every request gets
        ("chat", "chat", "bench-model", 16, False, key, 200),
        ("completions", "completions", "bench-model", 16, False, key, 200),
        ("embeddings", "embeddings", "bench-embed", 0, False, key, 200),
        ("chat stream 16", "chat", "bench-stream", 16, True, key, 200),
        ("chat stream 64", "chat", "bench-stream", 64, True, key, 200),
        ("429 rate limited", "chat", "bench-model", 16, False, limited, 429),
        ("401 bad key", "chat", "bench-model", 16, False, wrong, 401),
        ("404 unknown model", "chat", "no-such-model", 16, False, key, 404),
        ("responses", "responses", "bench-model", 16, False, key, 200),
        ("responses stream 64", "responses", "bench-stream", 64, True, key, 200),
        ("messages", "messages", "bench-model", 16, False, key, 200),
        ("messages stream 64", "messages", "bench-stream", 64, True, key, 200),
    ]
    fields = ("name", "api", "model", "tokens", "stream", "key", "status")
    return [dict(zip(fields, row, strict=True)) for row in rows]


def scope_for(spec: dict, body: bytes) -> dict:
    """The scope uvicorn builds for the request bench/gateway_load.py's aiohttp client sends."""
    auth = (
        (b"x-api-key", spec["key"].encode())
        if spec["api"] == "messages"
        else (b"authorization", b"Bearer " + spec["key"].encode())
    )
    headers = [
        (b"host", b"127.0.0.1:8000"),
        (b"accept", b"*/*"),
        (b"accept-encoding", b"gzip, deflate"),
        (b"user-agent", b"Python/3.11 aiohttp/3.14.5"),
        auth,
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    path = PATHS[spec["api"]]
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 40000),
        "scheme": "http",
        "method": "POST",
        "root_path": "",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": headers,
        "state": {},
    }


async def serve_one(app: Any, spec: dict, body: bytes) -> tuple[int, int]:
    """One request through the app: its status and how many body messages it sent."""
    sent: list[dict] = []
    delivered = False
    forever: asyncio.Future = asyncio.get_running_loop().create_future()

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await forever  # like uvicorn: nothing more until the client goes away

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope_for(spec, body), receive, send)
    forever.cancel()
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, sum(1 for m in sent if m["type"] == "http.response.body" and m.get("body"))


async def serve_many(app: Any, spec: dict, count: int, prime: bool = False) -> int:
    """``count`` requests one after another; every one must get the scenario's status
    (``prime``: first one request whatever it gets: the limited key's one a minute)."""
    body = request_body(spec["api"], spec["model"], spec["tokens"], spec["stream"])
    if prime:
        await serve_one(app, spec, body)
    chunks = 0
    for _ in range(count):
        status, parts = await serve_one(app, spec, body)
        if status != spec["status"]:
            raise RuntimeError(f"{spec['name']}: HTTP {status}, expected {spec['status']}")
        chunks += parts
    return chunks


class Bytecodes:
    """Bytecodes each Python function executes (its own, not its callees'): like callgrind's
    counts, exact and repeatable, but by Python function (callgrind sees only the
    interpreter's C functions)."""

    def __init__(self) -> None:
        self.counts: dict[Any, int] = {}

    def __enter__(self) -> Bytecodes:
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)

    def _call(self, frame: Any, event: str, arg: object) -> Any:
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        return self._opcode

    def _opcode(self, frame: Any, event: str, arg: object) -> Any:
        if event == "opcode":
            self.counts[frame.f_code] = self.counts.get(frame.f_code, 0) + 1
        return self._opcode

    def per_request(self, requests: int, tree: str) -> dict[str, float]:
        site = str(Path(os.__file__).parent)
        counts = {}
        for code, n in self.counts.items():
            path = code.co_filename.replace(tree + "/", "").split("site-packages/")[-1]
            name = f"{path.replace(site, 'lib')}:{code.co_firstlineno}({code.co_name})"
            counts[name] = counts.get(name, 0) + n / requests
        return counts


async def measure(
    helper: str,
    keys: dict[str, str],
    counts: dict[str, int],
    warm: int,
    bytecodes: bool,
    only: list[str],
) -> dict:
    import django

    django.setup()
    from config.asgi import application as app
    from gateway import app as gateway_app
    from gateway import metrics

    cg = ctypes.CDLL(helper)
    await app.gateway.startup()  # what the Dispatcher does on lifespan.startup
    rt = app.gateway.rt
    served = set(gateway_app.ENDPOINTS)
    specs = [s for s in scenarios(keys) if PATHS[s["api"]] in served]
    if only:
        specs = [s for s in specs if s["name"] in only]
    cg.cg_start()
    for spec in specs:  # every code path loaded and every connection open before counting
        await serve_many(app, spec, warm, prime=spec["status"] == 429)
    # Per-second timers, not per-request work (see the module docstring).
    for task in rt._tasks:
        task.cancel()
    await asyncio.gather(*rt._tasks, return_exceptions=True)
    metrics.flush()
    results = {}
    for spec in specs:
        count = counts["stream"] if spec["stream"] else counts["plain"]
        await serve_many(app, spec, warm, prime=spec["status"] == 429)
        cg.cg_zero()  # (not under valgrind: does nothing)
        with Bytecodes() if bytecodes else contextlib.nullcontext() as counter:
            chunks = await serve_many(app, spec, count)
            metrics.flush()  # what these requests left for the next per-second flush
        cg.cg_dump(spec["name"].encode())
        results[spec["name"]] = {"requests": count, "chunks": chunks}
        if counter:
            results[spec["name"]]["bytecodes"] = counter.per_request(count, os.getcwd())
    rt._tasks = []
    await app.gateway.shutdown()
    return results


def child_measure(args: argparse.Namespace) -> None:
    import uvloop  # what uvicorn runs the gateway on

    spec = json.loads(args.child_measure)
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    result = loop.run_until_complete(measure(**spec))
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # threads of the ORM's pool: do not wait for them under valgrind


# --- the orchestrator (this checkout's venv) ---------------------------------------------------


def sh(cmd: list[str], **kw: Any) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


def psql(sql: str) -> None:
    sh(["psql", f"{PG}/postgres", "-v", "ON_ERROR_STOP=1", "-q", "-c", sql])


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_sims() -> tuple[dict[str, int], list[subprocess.Popen]]:
    """The simulator engines (this checkout's engine_sim, outside valgrind), zero prefill."""
    import socket

    ports, procs = {}, []
    for name, (tokens, tps, runner) in SIMS.items():
        port = free_port()
        cmd = [sys.executable, "-m", "engine_sim", name, "--served-model-name", name]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096"]
        cmd += ["--max-num-seqs", "4096", "--runner", runner, "--sim-load-seconds", "0"]
        cmd += ["--sim-ttft-ms", "0", "--sim-ttft-per-token-ms", "0"]
        cmd += ["--sim-decode-tps", str(tps), "--sim-bandwidth-alpha", "0"]
        cmd += ["--sim-output-tokens-min", str(tokens), "--sim-output-tokens-max", str(tokens)]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
        ports[name] = port
    deadline = time.monotonic() + 60
    for port in ports.values():
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no simulator on {port}") from None
                time.sleep(0.1)
    return ports, procs


def build_helper(tmp: Path) -> str:
    src, lib = tmp / "cg.c", tmp / "libcg.so"
    src.write_text(HELPER_C)
    sh(["cc", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)])
    return str(lib)


def tree_env(tree: Path, db: str, prefix: str, tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "TOLLGATE_"))}
    metrics_dir = tmp / f"prom-{secrets.token_hex(4)}"
    metrics_dir.mkdir()
    env.update(
        TOLLGATE_ENV="test",
        DATABASE_URL=f"{PG}/{db}",
        TOLLGATE_REDIS_PREFIX=prefix,
        TOLLGATE_LOG_LEVEL="WARNING",
        DJANGO_SETTINGS_MODULE="config.settings",
        PROMETHEUS_MULTIPROC_DIR=str(metrics_dir),  # as config/gunicorn.py sets it
        PYTHONHASHSEED="0",
        PYTHONPATH=str(tree),
    )
    return env


def callgrind_totals(out_dir: Path, stem: str) -> dict[str, int]:
    """Scenario name -> instructions, from the dumps the client requests wrote."""
    totals = {}
    for path in sorted(out_dir.glob(f"{stem}.*")):
        name, total = None, None
        with open(path) as f:
            for line in f:
                if line.startswith("desc: Trigger: Client Request: "):
                    name = line.split(": ", 3)[-1].strip()
                elif line.startswith(("summary:", "totals:")):
                    total = int(line.split()[1])
        if name and total is not None:
            totals[name] = total
    return totals


def run_tree(
    label: str, tree: Path, db: str, keys: dict, args: argparse.Namespace, tmp: Path, run: int
) -> dict[str, dict]:
    prefix = f"bench-i17-{label}-{secrets.token_hex(3)}"
    env = tree_env(tree, db, prefix, tmp)
    out_dir = Path(args.keep) if args.keep else tmp
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"callgrind.{label}.{run}"
    spec = {
        "helper": args.helper,
        "keys": keys,
        "counts": {"plain": args.requests, "stream": args.streams},
        "warm": args.warm,
        "bytecodes": args.bytecodes,
        "only": [n.strip() for n in args.scenarios.split(",")] if args.scenarios else [],
    }
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
    valgrind.append(f"--callgrind-out-file={out_dir / stem}")
    cmd = [
        *([] if args.bytecodes else valgrind),
        str(tree / ".venv" / "bin" / "python"),
        str(Path(__file__).resolve()),
        "--child-measure",
        json.dumps(spec),
    ]
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    finally:
        keys_left = sh(["redis-cli", "--scan", "--pattern", f"{prefix}*"]).split()
        for i in range(0, len(keys_left), 500):
            sh(["redis-cli", "del", *keys_left[i : i + 500]])
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(
            f"{label}: measuring failed\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    counts = json.loads(line.removeprefix("RESULT "))
    if args.bytecodes:
        return counts
    totals = callgrind_totals(out_dir, stem)
    return {name: {**c, "instructions": totals[name]} for name, c in counts.items()}


def per_request(res: dict[str, dict]) -> dict[str, float]:
    """Instructions per request per scenario, and per streamed chunk beyond the 16th token."""
    rows = {name: r["instructions"] / r["requests"] for name, r in res.items()}
    short, long = res.get("chat stream 16"), res.get("chat stream 64")
    if short and long:
        extra = long["chunks"] / long["requests"] - short["chunks"] / short["requests"]
        rows["chat stream, per chunk"] = (rows["chat stream 64"] - rows["chat stream 16"]) / extra
    return rows


def table(labels: list[str], runs: dict[str, list[dict[str, float]]], base: str) -> str:
    names: list[str] = []
    for label in labels:
        for row in runs[label]:
            names += [n for n in row if n not in names]
    head = "| scenario | " + " | ".join(f"{lb} (runs)" for lb in labels)
    head += "".join(f" | {lb} / {base}" for lb in labels if lb != base) + " |"
    lines = [head, "|---|" + "---:|" * (len(labels) * 2 - 1)]
    for name in names:
        cells, means = [], {}
        for label in labels:
            values = [row[name] for row in runs[label] if name in row]
            if not values:
                cells.append("–")
                continue
            means[label] = statistics.mean(values)
            cells.append(" / ".join(f"{v / 1000:,.0f}k" for v in values))
        for label in labels:
            if label == base:
                continue
            ok = label in means and base in means
            cells.append(f"{means[label] / means[base]:.3f}" if ok else "–")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def by_name(counts: dict[str, float]) -> dict[str, float]:
    """Counts by module and function name: a function that moved lines is still itself."""
    named: dict[str, float] = {}
    for where, n in counts.items():
        path, _, rest = where.rpartition(":")
        key = f"{path}:{rest.split('(', 1)[1].rstrip(')')}"
        named[key] = named.get(key, 0) + n
    return named


def bytecodes_diff(labels: list[str], raw: dict[str, list[dict]], base: str, top: int = 30) -> str:
    """Per scenario: the Python functions whose bytecodes per request differ from ``base``'s."""
    lines = []
    for name, res in raw[base][0].items():
        for label in labels:
            if label == base or name not in raw[label][0]:
                continue
            mine, theirs = by_name(raw[label][0][name]["bytecodes"]), by_name(res["bytecodes"])
            diff = {f: mine.get(f, 0) - theirs.get(f, 0) for f in {*mine, *theirs}}
            diff = {f: d for f, d in diff.items() if abs(d) >= 1}
            total = sum(mine.values()) - sum(theirs.values())
            lines.append(f"\n{name}: {label} - {base}: {total:+.0f} bytecodes a request")
            for f, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]:
                lines.append(f"  {d:+7.1f}  {f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tree", action="append", default=[], help="LABEL=PATH (repeatable)")
    ap.add_argument("--repeat", type=int, default=2, help="rounds over all trees")
    ap.add_argument("--requests", type=int, default=100, help="per non-streaming scenario")
    ap.add_argument("--streams", type=int, default=20, help="per streaming scenario")
    ap.add_argument("--scenarios", default="", help="only these (comma-separated names)")
    ap.add_argument("--warm", type=int, default=5, help="requests before each count")
    ap.add_argument("--base", default=None, help="the label ratios are taken against")
    ap.add_argument("--db-prefix", default="bench_i17", help="throw-away databases: PREFIX_<label>")
    ap.add_argument("--keep", default=None, help="keep the callgrind files in this folder")
    ap.add_argument(
        "--bytecodes",
        action="store_true",
        help="no valgrind: list the Python functions whose bytecodes per request differ "
        "from --base's, per scenario (where the extra instructions come from)",
    )
    ap.add_argument("--child-measure", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-setup", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up on a plain kill too
    if args.child_measure:
        return child_measure(args)
    if args.child_setup:
        print("KEYS " + json.dumps(setup_rows(json.loads(args.child_setup))), flush=True)
        return
    trees = dict(t.split("=", 1) for t in (args.tree or [f"this={ROOT}"]))
    trees = {label: Path(p).resolve() for label, p in trees.items()}
    labels = list(trees)
    base = args.base or labels[0]
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    tmp = Path(tempfile.mkdtemp(prefix="gwinstr-"))
    args.helper = build_helper(tmp)
    ports, sims = start_sims()
    made: list[str] = []
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
    raw: dict[str, list[dict]] = {label: [] for label in labels}
    try:
        keys = {}
        for label, tree in trees.items():
            db = f"{args.db_prefix}_{label.replace('-', '_')}"
            psql(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
            psql(f"CREATE DATABASE {db}")
            made.append(db)
            env = tree_env(tree, db, "bench-i17-setup", tmp)
            python = str(tree / ".venv" / "bin" / "python")
            sh([python, "manage.py", "migrate", "--noinput"], cwd=tree, env=env)
            out = sh(
                [python, str(Path(__file__).resolve()), "--child-setup", json.dumps(ports)],
                cwd=tree,
                env=env,
            )
            keys[label] = json.loads(out.split("KEYS ", 1)[1])
        for run in range(args.repeat):
            for label, tree in trees.items():
                db = f"{args.db_prefix}_{label.replace('-', '_')}"
                print(f"run {run + 1}: {label} …", file=sys.stderr, flush=True)
                res = run_tree(label, tree, db, keys[label], args, tmp, run)
                raw[label].append(res)
                if not args.bytecodes:
                    runs[label].append(per_request(res))
    finally:
        for proc in sims:
            proc.terminate()
            proc.wait()
        for db in made:
            with contextlib.suppress(subprocess.CalledProcessError):
                psql(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        shutil.rmtree(tmp, ignore_errors=True)
    commits = {
        label: sh(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"]).strip()
        for label, tree in trees.items()
    }
    if args.bytecodes:
        print(bytecodes_diff(labels, raw, base))
        return
    print(json.dumps(raw), file=sys.stderr)
    print(
        f"\n$ .venv/bin/python bench/gateway_instructions.py {' '.join(sys.argv[1:])}\n"
        f"`nproc` {os.cpu_count()}, `uname -m` {platform.machine()}, Python "
        f"{platform.python_version()}, {sh(['valgrind', '--version']).strip()}; {started}; "
        f"trees: " + ", ".join(f"{lb} {c}" for lb, c in commits.items()) + "\n"
    )
    print(table(labels, runs, base))


if __name__ == "__main__":
    main()
