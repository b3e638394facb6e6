"""Gateway overhead: direct-to-engine vs Tollgate vs the LiteLLM proxy, in one run.

Starts three simulator engines (zero-delay; 64 tokens 5 ms apart; 200 tokens 50 ms
apart), a throw-away PostgreSQL database and Redis prefix with one tenant/key/price (rate
limits on but never reached, metering on), then for each column — direct, Tollgate with 1
and 2 gunicorn workers (and with 2 workers on the aiohttp upstream client instead of its
own, side by side), LiteLLM with 1 and 2 workers — runs the same closed-loop scenarios
from a separate load-generator process (bench/gateway_load.py, aiohttp client):

  json c=1/16/64      16-token replies, no delay: added latency, requests/s, CPU per request
  stream c=1/16/64    64 tokens 5 ms apart: time to first token, token rate, CPU per chunk
  hold                1,000 concurrent streams of 200 tokens 50 ms apart: errors, RSS
  <api> json c=1      the agent APIs (EXTRA_APIS: /v1/responses, /v1/messages) beside chat:
  <api> stream c=64   added latency and the token rate at 64 streams, same engines

Server CPU is the utime+stime of the server's whole process tree (from /proc) before and
after each scenario; memory is the peak summed RSS of its workers while the streams are
held. LiteLLM is installed on demand into .bench-venvs/litellm (not committed).

``Tollgate w2 appliance`` is the appliance as it really runs (bench/gateway_appliance.py):
web with 2 workers and its access log, the Celery worker, beat and the usage consumer, all
on the same cores with production settings; its CPU is every one of those processes', also
split by process, and after each scenario the bench waits for the usage consumer to bring
the stream's backlog back to 0 (the time it took is a row of the table).

A column named "Tollgate wN tls" puts the appliance's TLS front in front of the gateway:
Caddy (Debian's `caddy` package on this host: apt-get install caddy) with the appliance's
own compose/caddy/Caddyfile and its internal CA, the load generator trusting only that CA.
Caddy's CPU and memory count as the server's. Its verdict: streaming token rate within 10%
of the plain column's in the same run.

    .venv/bin/python bench/gateway_bench.py --columns "direct,Tollgate w2,Tollgate w2 tls" --hold 0

A column named "Tollgate wN before" runs the gateway of another checkout (``--before PATH``,
e.g. ``git worktree add /tmp/before <commit>``) with this tree's venv and database, so a
change is measured side by side with what came before it, in one run:

    .venv/bin/python bench/gateway_bench.py --before /tmp/before \
        --columns "direct,Tollgate w2 before,Tollgate w2" --hold 0

    .venv/bin/python bench/gateway_bench.py            # print the table
    .venv/bin/python bench/gateway_bench.py --write    # and replace the section in bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import secrets
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv" / "bin" / "python")
LITELLM_VERSION = "1.108.7"
LITELLM_VENV = ROOT / ".bench-venvs" / "litellm"
DB_NAME = "tollgate_bench"
PG = "postgres://postgres@127.0.0.1:5432"
SECTION = "## Gateway overhead"
CADDY = shutil.which("caddy") or "/usr/bin/caddy"
PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")

# name -> (tokens per reply, decode tokens/s per sequence; 0 = no delay)
SIMS = {"bench-model": (16, 0), "bench-stream": (64, 200), "bench-hold": (200, 20)}
# APIs measured beside chat (bench/gateway_load.py builds their requests and reads their
# answers): added p50 at c=1 and the token rate at 64 streams, chat's targets.
EXTRA_APIS = ("responses", "messages")


# --- processes ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listening on {port}")


def children(pid: int) -> list[int]:
    """All descendants of ``pid`` (from /proc's parent links)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    found, pending = [], [pid]
    while pending:
        for child in parents.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / TICK


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
    return total


@dataclass
class Server:
    """A process we started, and how to find its workers."""

    proc: subprocess.Popen
    pids: list[int] = field(default_factory=list)  # root + descendants, fixed once warm

    def refresh(self) -> None:
        self.pids = [self.proc.pid, *children(self.proc.pid)]

    @property
    def workers(self) -> list[int]:
        return self.pids[1:] or self.pids[:1]

    def stop(self) -> None:
        self.refresh()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for pid in self.pids[1:]:  # a worker its parent left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def start_sim(name: str, tokens: int, tps: float) -> tuple[int, Server]:
    port = free_port()
    cmd = [
        PY,
        "-m",
        "engine_sim",
        name,
        "--served-model-name",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "4096",
        "--sim-load-seconds",
        "0",
        "--sim-ttft-ms",
        "0",
        "--sim-ttft-per-token-ms",
        "0",
        "--sim-decode-tps",
        str(tps),
        "--sim-bandwidth-alpha",
        "0",
        "--sim-output-tokens-min",
        str(tokens),
        "--sim-output-tokens-max",
        str(tokens),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Server(proc)
    wait_listening(port, proc)
    return port, server


def start_tollgate(
    workers: int,
    env: dict,
    key: str,
    log: Path,
    app: str = "config.asgi:application",
    tree: Path = ROOT,
) -> tuple[str, Server]:
    """The gateway under gunicorn, from the source tree ``tree`` (another checkout, e.g.
    an earlier commit's, for a before/after column; this venv and database)."""
    port = free_port()
    cmd = [
        PY,
        "-m",
        "gunicorn",
        "-c",
        "python:config.gunicorn",
        app,
        "-w",
        str(workers),
        "-b",
        f"127.0.0.1:{port}",
        "--graceful-timeout",
        "5",
    ]
    proc = subprocess.Popen(
        cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "a")
    )
    server = Server(proc)
    wait_listening(port, proc)
    url = f"http://127.0.0.1:{port}"
    wait_serving(url, key, proc)
    return url, server


def wait_serving(
    url: str,
    key: str | None,
    proc: subprocess.Popen,
    timeout: float = 90.0,
    ca: str | None = None,
    models: frozenset[str] = frozenset(SIMS),
) -> None:
    """Until several /v1/models calls in a row list every one of ``models`` (all workers
    up; default: this bench's)."""
    tls = ssl.create_default_context(cafile=ca) if ca else None
    deadline, streak = time.monotonic() + timeout, 0
    while time.monotonic() < deadline and streak < 8:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        req = urllib.request.Request(
            url + "/v1/models", headers={"Authorization": f"Bearer {key or 'none'}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=5, context=tls) as r:
                names = {m["id"] for m in json.load(r)["data"]}
            streak = streak + 1 if models <= names else 0
        except OSError:
            streak = 0
        time.sleep(0.1)
    if streak < 8:
        raise TimeoutError(f"{url} did not serve the bench models in {timeout}s")


@dataclass
class Fronted(Server):
    """The gateway with the TLS front (Caddy) before it: both processes count as the server."""

    front: Server | None = None

    def refresh(self) -> None:
        super().refresh()
        if self.front:
            self.front.refresh()
            self.pids += self.front.pids

    def stop(self) -> None:
        if self.front:
            self.front.stop()
        super().stop()


def start_tls_front(upstream: str, key: str, tmp: Path, log: Path) -> tuple[str, str, Server]:
    """Caddy with the appliance's Caddyfile and internal CA in front of ``upstream``."""
    https, http = free_port(), free_port()
    env = {
        **os.environ,
        "XDG_DATA_HOME": str(tmp / "caddy-data"),
        "XDG_CONFIG_HOME": str(tmp / "caddy-config"),
        "TOLLGATE_TLS_UPSTREAM": upstream.removeprefix("http://"),
        "TOLLGATE_TLS_GATEWAY": upstream.removeprefix("http://"),
        "TOLLGATE_TLS_NAMES": "127.0.0.1",
        "TOLLGATE_TLS_DEFAULT_NAME": "127.0.0.1",
        "TOLLGATE_TLS_LISTEN_HTTPS": str(https),
        "TOLLGATE_TLS_LISTEN_HTTP": str(http),
        "TOLLGATE_HTTPS_PORT": str(https),
    }
    caddyfile = ROOT / "compose" / "caddy" / "Caddyfile"
    cmd = [CADDY, "run", "--config", str(caddyfile), "--adapter", "caddyfile"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "a"))
    server = Server(proc)
    wait_listening(https, proc)
    ca = tmp / "caddy-data" / "caddy" / "pki" / "authorities" / "local" / "root.crt"
    deadline = time.monotonic() + 30
    while not ca.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    url = f"https://127.0.0.1:{https}"
    wait_serving(url, key, proc, ca=str(ca))
    return url, str(ca), server


def ensure_litellm() -> Path:
    exe = LITELLM_VENV / "bin" / "litellm"
    pip = LITELLM_VENV / "bin" / "pip"
    if exe.exists():
        out = subprocess.run([str(pip), "show", "litellm"], capture_output=True, text=True).stdout
        if f"Version: {LITELLM_VERSION}" in out:
            return exe
    print(f"installing litellm[proxy]=={LITELLM_VERSION} into {LITELLM_VENV} …", file=sys.stderr)
    LITELLM_VENV.parent.mkdir(exist_ok=True)
    if not (LITELLM_VENV / "bin" / "python").exists():
        subprocess.run(["python3", "-m", "venv", str(LITELLM_VENV)], check=True)
    subprocess.run([str(pip), "install", "-q", f"litellm[proxy]=={LITELLM_VERSION}"], check=True)
    return exe


def start_litellm(
    workers: int, ports: dict[str, int], tmp: Path, log: Path
) -> tuple[str, str, Server]:
    """LiteLLM without a database; its master key is the only credential (it needs one to run)."""
    exe = ensure_litellm()
    master = f"sk-{secrets.token_hex(32)}"
    lines = ["model_list:"]
    for name, port in ports.items():
        lines += [
            f"  - model_name: {name}",
            "    litellm_params:",
            f"      model: openai/{name}",
            f"      api_base: http://127.0.0.1:{port}/v1",
            "      api_key: sk-bench",
        ]
    lines += [
        "litellm_settings:",
        "  telemetry: false",
        "  set_verbose: false",
        "  drop_params: true",
        "  turn_off_message_logging: true",
        "general_settings:",
        f"  master_key: {master}",
    ]
    config = tmp / "litellm.yaml"
    config.write_text("\n".join(lines) + "\n")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DATABASE_URL", "REDIS", "LITELLM"))
    }
    env.update(
        LITELLM_LOG="ERROR",
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        LITELLM_TELEMETRY="False",
        TELEMETRY="False",
        DISABLE_SCHEMA_UPDATE="True",
        NO_DOCS="True",
    )
    port = free_port()
    cmd = [
        str(exe),
        "--config",
        str(config),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num_workers",
        str(workers),
    ]
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=open(log, "a"), stderr=subprocess.STDOUT)
    print(f"  (LiteLLM log: {log})", file=sys.stderr)
    server = Server(proc)
    try:
        # Its supervisor restarts a worker that imports slower than its health check allows,
        # so on a loaded machine LiteLLM can take minutes to listen (over 10 at load 12-14).
        wait_listening(port, proc, timeout=300)
        url = f"http://127.0.0.1:{port}"
        wait_serving(url, master, proc)
    except BaseException:
        server.stop()  # not yet among the stack's servers: nothing else would stop it
        raise
    return url, master, server


# --- the load generator ---------------------------------------------------------------------


class Load:
    """The separate client process: one JSON scenario in, one JSON result out."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [PY, str(ROOT / "bench" / "gateway_load.py")],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert json.loads(self.proc.stdout.readline()).get("ready")

    def run(self, spec: dict) -> dict:
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("load generator died")
        return json.loads(line)

    ca: str | None = None  # set: the server is behind the TLS front, trust only this CA

    def reset(self) -> None:
        """Close the client's connections: the next scenario opens fresh ones."""
        assert self.run({"reset": True, "ca": self.ca}).get("reset")

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class PeakRss(threading.Thread):
    """Samples the summed RSS of some processes every 100 ms; keeps the peak."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.pids, self.peak, self.done = pids, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.1):
            self.peak = max(self.peak, rss_bytes(self.pids))

    def __enter__(self) -> PeakRss:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.join()


# --- scenarios --------------------------------------------------------------------------------


@dataclass
class Column:
    name: str
    url_for: dict[str, str]  # model -> base URL
    key: str | None
    server: Server | None


def scenarios(scale: float) -> list[tuple[str, dict]]:
    d = lambda s: max(1.0, s * scale)  # noqa: E731
    return [
        (
            "json c=1",
            {
                "model": "bench-model",
                "stream": False,
                "concurrency": 1,
                "duration": d(4),
                "requests": 20000,
            },
        ),
        (
            "json c=16",
            {
                "model": "bench-model",
                "stream": False,
                "concurrency": 16,
                "duration": d(3),
                "requests": 50000,
            },
        ),
        (
            "json c=64",
            {
                "model": "bench-model",
                "stream": False,
                "concurrency": 64,
                "duration": d(5),
                "requests": 50000,
            },
        ),
        (
            "stream c=1",
            {
                "model": "bench-stream",
                "stream": True,
                "concurrency": 1,
                "duration": d(5),
                "requests": 1000,
            },
        ),
        # Equal-length streams stay in step: all 16 (64) end and start again together, so each
        # run's result depends on how its connections happen to be spread over the server's
        # workers. Three rounds on fresh connections, pooled, give the typical value.
        (
            "stream c=16",
            {
                "model": "bench-stream",
                "stream": True,
                "concurrency": 16,
                "duration": d(3),
                "requests": 10000,
                "rounds": 3,
            },
        ),
        (
            "stream c=64",
            {
                "model": "bench-stream",
                "stream": True,
                "concurrency": 64,
                "duration": d(3),
                "requests": 10000,
                "rounds": 3,
            },
        ),
        *(scenario for api in EXTRA_APIS for scenario in api_scenarios(api, d)),
    ]


def api_scenarios(api: str, d: object) -> list[tuple[str, dict]]:
    return [
        (
            f"{api} json c=1",
            {
                "api": api,
                "model": "bench-model",
                "stream": False,
                "concurrency": 1,
                "duration": d(4),
                "requests": 20000,
            },
        ),
        (
            f"{api} stream c=64",
            {
                "api": api,
                "model": "bench-stream",
                "stream": True,
                "concurrency": 64,
                "duration": d(3),
                "requests": 10000,
                "rounds": 3,
            },
        ),
    ]


def run_rounds(load: Load, col: Column, spec: dict) -> dict:
    """``spec["rounds"]`` runs of a scenario, each on fresh connections, as one pooled result."""
    runs = []
    for _ in range(spec.get("rounds", 1)):
        load.reset()
        runs.append(run_scenario(load, col, {**spec, "raw": True}))
    pooled = {
        k: sum(r[k] for r in runs)
        for k in ("requests", "errors", "seconds", "tokens", "frames", "client_cpu_s")
    }
    pooled["server_cpu_s"] = sum(r["server_cpu_s"] for r in runs) if col.server else None
    pooled["peak_rss"] = max(r["peak_rss"] for r in runs) if col.server else None
    pooled["first_error"] = next((r["first_error"] for r in runs if r["first_error"]), "")
    if "drain_s" in runs[0]:
        drains = [r["drain_s"] for r in runs]
        pooled["drain_s"] = None if None in drains else max(drains)
        pooled["cpu_parts"] = {
            k: sum(r["cpu_parts"][k] for r in runs) for k in runs[0]["cpu_parts"]
        }
    pooled["rps"], pooled["tok_s"] = (
        pooled["requests"] / pooled["seconds"],
        pooled["tokens"] / pooled["seconds"],
    )
    for key in ("lat", "ttft"):
        values = sorted(v for r in runs for v in r[f"{key}_all"])
        pooled[f"{key}_p50"] = values[int(round(0.5 * (len(values) - 1)))] if values else None
        pooled[f"{key}_p99"] = values[int(round(0.99 * (len(values) - 1)))] if values else None
    return pooled


def run_scenario(load: Load, col: Column, spec: dict) -> dict:
    spec = {
        **spec,
        "url": col.url_for[spec["model"]],
        "key": col.key,
        "tokens": SIMS[spec["model"]][0],
    }
    pids = col.server.pids if col.server else []
    by_part = getattr(col.server, "cpu_by_part", None)  # the whole appliance
    parts0 = by_part() if by_part else {}
    cpu0 = cpu_seconds(pids)
    with PeakRss(col.server.workers if col.server else []) as rss:
        result = load.run(spec)
    result["server_cpu_s"] = cpu_seconds(pids) - cpu0 if col.server else None
    result["peak_rss"] = rss.peak if col.server else None
    if by_part:
        result["cpu_parts"] = {k: v - parts0[k] for k, v in by_part().items()}
        # After the load: how long the usage consumer takes to ingest the backlog.
        result["drain_s"] = col.server.drain_seconds()
    return result


def run_column(load: Load, col: Column, scale: float, hold: int) -> dict[str, dict]:
    out: dict[str, dict] = {}
    # A fresh client session: the previous column's held streams leave ~1,000 connections
    # to a server that is gone, and cleaning those up slowed the client in the next column.
    load.reset()
    # Warm-up: imports, caches, connection pools, JIT-free but lazy paths.
    run_scenario(
        load,
        col,
        {
            "model": "bench-model",
            "stream": False,
            "concurrency": 16,
            "duration": 2,
            "requests": 2000,
        },
    )
    run_scenario(
        load,
        col,
        {
            "model": "bench-stream",
            "stream": True,
            "concurrency": 16,
            "duration": 1,
            "requests": 200,
        },
    )
    if col.server:
        col.server.refresh()
    for name, spec in scenarios(scale):
        out[name] = r = (
            run_rounds(load, col, spec) if "rounds" in spec else run_scenario(load, col, spec)
        )
        print(
            f"  {col.name:<12} {name:<12} n={r['requests']:<6} err={r['errors']:<3} "
            f"p50={fmt(r['lat_p50'], 2)} ms p99={fmt(r['lat_p99'], 2)} ms "
            f"ttft50={fmt(r['ttft_p50'], 2)} "
            f"rps={r['rps']:.0f} tok/s={r['tok_s']:.0f} cpu={fmt(r['server_cpu_s'], 2)} s "
            f"{r['first_error']}",
            file=sys.stderr,
            flush=True,
        )
    if hold:
        base = rss_bytes(col.server.workers) if col.server else 0
        spec = {
            "model": "bench-hold",
            "stream": True,
            "concurrency": hold,
            "duration": 120,
            "requests": hold,
        }
        r = run_scenario(load, col, spec)
        r["base_rss"] = base
        out["hold"] = r
        print(
            f"  {col.name:<12} hold {hold:<7} n={r['requests']} err={r['errors']} peak RSS="
            f"{fmt((r['peak_rss'] or 0) / 2**20, 0)} MB (idle {base / 2**20:.0f} MB) "
            f"ttft99={fmt(r['ttft_p99'], 0)} ms {r['first_error']}",
            file=sys.stderr,
            flush=True,
        )
    return out


# --- report ------------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def table(cols: list[str], res: dict[str, dict[str, dict]]) -> tuple[str, dict[str, float | None]]:
    direct = res.get("direct", {})
    rows: list[tuple[str, list[str]]] = []
    facts: dict[str, float | None] = {}

    def get(col: str, scen: str, metric: str) -> float | None:
        return res.get(col, {}).get(scen, {}).get(metric)

    def added(col: str, scen: str, metric: str) -> float | None:
        a, b = get(col, scen, metric), direct.get(scen, {}).get(metric)
        return None if a is None or b is None or col == "direct" else a - b

    for c in (1, 16, 64):
        s = f"json c={c}"
        rows.append(
            (
                f"non-streaming c={c}: p50 / p99 latency, ms",
                [f"{fmt(get(k, s, 'lat_p50'), 2)} / {fmt(get(k, s, 'lat_p99'), 2)}" for k in cols],
            )
        )
        rows.append(
            (
                f"non-streaming c={c}: added p50 / p99, ms",
                [
                    f"{fmt(added(k, s, 'lat_p50'), 2)} / {fmt(added(k, s, 'lat_p99'), 2)}"
                    for k in cols
                ],
            )
        )
        rows.append((f"non-streaming c={c}: requests/s", [fmt(get(k, s, "rps"), 0) for k in cols]))
    for c in (1, 16, 64):
        s = f"stream c={c}"
        rows.append(
            (
                f"streaming c={c}: TTFT p50 / p99, ms",
                [
                    f"{fmt(get(k, s, 'ttft_p50'), 2)} / {fmt(get(k, s, 'ttft_p99'), 2)}"
                    for k in cols
                ],
            )
        )
        rows.append(
            (
                f"streaming c={c}: added TTFT p50 / p99, ms",
                [
                    f"{fmt(added(k, s, 'ttft_p50'), 2)} / {fmt(added(k, s, 'ttft_p99'), 2)}"
                    for k in cols
                ],
            )
        )
        rows.append(
            (
                f"streaming c={c}: added total p50 / p99, ms",
                [
                    f"{fmt(added(k, s, 'lat_p50'), 2)} / {fmt(added(k, s, 'lat_p99'), 2)}"
                    for k in cols
                ],
            )
        )
        ratio = []
        for k in cols:
            a, b = get(k, s, "tok_s"), direct.get(s, {}).get("tok_s")
            ratio.append(f"{fmt(a, 0)} ({a / b:.2f})" if a is not None and b else fmt(a, 0))
        rows.append((f"streaming c={c}: tokens/s (vs direct)", ratio))
    per_req, per_chunk, net_chunk = [], [], []
    for k in cols:
        j, st = res.get(k, {}).get("json c=64", {}), res.get(k, {}).get("stream c=64", {})
        cpu_req = (
            j["server_cpu_s"] / j["requests"]
            if j.get("server_cpu_s") is not None and j.get("requests")
            else None
        )
        per_req.append(fmt(cpu_req * 1000 if cpu_req is not None else None, 3))
        if st.get("server_cpu_s") is not None and st.get("frames"):
            per_chunk.append(fmt(st["server_cpu_s"] / st["frames"] * 1e6, 1))
            net = (st["server_cpu_s"] - st["requests"] * (cpu_req or 0)) / st["frames"]
            net_chunk.append(fmt(net * 1e6, 1))
        else:
            per_chunk.append("–")
            net_chunk.append("–")
        facts[f"{k}.cpu_req_ms"] = cpu_req * 1000 if cpu_req is not None else None
    for api in EXTRA_APIS:
        s = f"{api} json c=1"
        rows.append(
            (
                f"{api} non-streaming c=1: p50 / p99 latency, ms",
                [f"{fmt(get(k, s, 'lat_p50'), 2)} / {fmt(get(k, s, 'lat_p99'), 2)}" for k in cols],
            )
        )
        rows.append(
            (
                f"{api} non-streaming c=1: added p50 / p99, ms",
                [
                    f"{fmt(added(k, s, 'lat_p50'), 2)} / {fmt(added(k, s, 'lat_p99'), 2)}"
                    for k in cols
                ],
            )
        )
        s = f"{api} stream c=64"
        ratio = []
        for k in cols:
            a, b = get(k, s, "tok_s"), direct.get(s, {}).get("tok_s")
            ratio.append(f"{fmt(a, 0)} ({a / b:.2f})" if a is not None and b else fmt(a, 0))
        rows.append((f"{api} streaming c=64: tokens/s (vs direct)", ratio))
    rows.append(("server CPU per request (json c=64), ms", per_req))
    parts_row, drain_row = [], []
    for k in cols:
        j = res.get(k, {}).get("json c=64", {})
        parts = j.get("cpu_parts")
        parts_row.append(
            " / ".join(f"{n} {v / j['requests'] * 1000:.3f}" for n, v in parts.items())
            if parts and j.get("requests")
            else "–"
        )
        drains = [r.get("drain_s", "–") for r in res.get(k, {}).values() if "drain_s" in r]
        worst = None if None in drains else max(drains, default=None)
        drain_row.append(("not in 30 s" if None in drains else fmt(worst, 2)) if drains else "–")
        facts[f"{k}.drain_s"] = worst if drains else None
        facts[f"{k}.drained"] = (None not in drains) if drains else None
    rows.append(("  … by process (json c=64), ms", parts_row))
    rows.append(("usage backlog back to 0 after a scenario, s (worst)", drain_row))
    rows.append(("server CPU per streamed chunk (stream c=64, all CPU / chunks), µs", per_chunk))
    rows.append(("  … net of the per-request cost, µs", net_chunk))
    rows.append(
        (
            "client CPU per request (json c=64), ms",
            [
                fmt(get(k, "json c=64", "client_cpu_s") / get(k, "json c=64", "requests") * 1000, 3)
                if get(k, "json c=64", "requests")
                else "–"
                for k in cols
            ],
        )
    )
    hold_rows = [[], [], []]
    for k in cols:
        h = res.get(k, {}).get("hold")
        if not h:
            hold_rows[0].append("–")
            hold_rows[1].append("–")
            hold_rows[2].append("–")
            continue
        hold_rows[0].append(f"{h['requests']} ok / {h['errors']} err")
        if h.get("peak_rss"):
            hold_rows[1].append(f"{h['peak_rss'] / 2**20:,.0f} (idle {h['base_rss'] / 2**20:,.0f})")
            hold_rows[2].append(
                fmt((h["peak_rss"] - h["base_rss"]) / max(h["requests"] + h["errors"], 1) / 1024, 0)
            )
        else:
            hold_rows[1].append("–")
            hold_rows[2].append("–")
    rows.append(("1,000 streams (200 tok, 50 ms apart): completed", hold_rows[0]))
    rows.append(("1,000 streams: peak RSS of the workers, MB", hold_rows[1]))
    rows.append(("1,000 streams: RSS per stream, kB", hold_rows[2]))

    width = max(len(r[0]) for r in rows)
    cw = [max(len(k), *(len(r[1][i]) for r in rows)) for i, k in enumerate(cols)]
    lines = [
        "| "
        + "metric".ljust(width)
        + " | "
        + " | ".join(k.rjust(w) for k, w in zip(cols, cw, strict=True))
        + " |",
        "|" + "-" * (width + 2) + "|" + "|".join("-" * (w + 1) + ":" for w in cw) + "|",
    ]
    for label, vals in rows:
        lines.append(
            "| "
            + label.ljust(width)
            + " | "
            + " | ".join(v.rjust(w) for v, w in zip(vals, cw, strict=True))
            + " |"
        )

    for k in cols:
        facts[f"{k}.added_p50_c1"] = added(k, "json c=1", "lat_p50")
        facts[f"{k}.added_ttft_c16"] = added(k, "stream c=16", "ttft_p50")
        facts[f"{k}.rps_c64"] = get(k, "json c=64", "rps")
        a, b = get(k, "stream c=64", "tok_s"), direct.get("stream c=64", {}).get("tok_s")
        facts[f"{k}.tok_ratio_c64"] = a / b if a is not None and b else None
        for api in EXTRA_APIS:
            facts[f"{k}.{api}.added_p50_c1"] = added(k, f"{api} json c=1", "lat_p50")
            s = f"{api} stream c=64"
            a, b = get(k, s, "tok_s"), direct.get(s, {}).get("tok_s")
            facts[f"{k}.{api}.tok_ratio_c64"] = a / b if a is not None and b else None
        h = res.get(k, {}).get("hold")
        facts[f"{k}.hold_errors"] = h["errors"] if h else None
        facts[f"{k}.hold_ok"] = h["requests"] if h else None
        facts[f"{k}.hold_rss"] = h["peak_rss"] / 2**20 if h and h.get("peak_rss") else None
    return "\n".join(lines), facts


def verdicts(facts: dict[str, float | None], hold: int) -> list[str]:
    out = []
    for g in ("Tollgate w2 appliance", "Tollgate w2", "Tollgate w1"):
        if facts.get(f"{g}.rps_c64") is None:
            continue
        if facts.get(f"{g}.drained") is not None:
            v = facts[f"{g}.drain_s"]
            out.append(
                f"- {g}: usage stream backlog back to 0 within 10 s of each scenario: "
                f"{'met' if facts[f'{g}.drained'] and v <= 10 else 'MISSED'} "
                f"(worst {fmt(v, 2)} s)"
            )
        v = facts[f"{g}.added_p50_c1"]
        out.append(
            f"- {g}: added p50 at c=1, non-streaming ≤ 1.0 ms: "
            f"{'met' if v is not None and v <= 1.0 else 'MISSED'} ({fmt(v, 2)} ms)"
        )
        v = facts[f"{g}.added_ttft_c16"]
        out.append(
            f"- {g}: added TTFT p50 at c=16 ≤ 2 ms: "
            f"{'met' if v is not None and v <= 2.0 else 'MISSED'} ({fmt(v, 2)} ms)"
        )
        lite = facts.get("LiteLLM w2.rps_c64")
        if lite:
            x = facts[f"{g}.rps_c64"] / lite
            out.append(
                f"- {g}: req/s at c=64 ≥ 12× LiteLLM w2: {'met' if x >= 12 else 'MISSED'} "
                f"({fmt(facts[f'{g}.rps_c64'], 0)} vs {fmt(lite, 0)} req/s = {x:.1f}×)"
            )
        v = facts[f"{g}.tok_ratio_c64"]
        out.append(
            f"- {g}: token rate at 64 streams ≥ 95% of direct: "
            f"{'met' if v is not None and v >= 0.95 else 'MISSED'} "
            f"({fmt(v * 100 if v else None, 1)}%)"
        )
        for api in EXTRA_APIS:
            v = facts.get(f"{g}.{api}.added_p50_c1")
            out.append(
                f"- {g}: /v1/{api} added p50 at c=1, non-streaming ≤ 1.0 ms: "
                f"{'met' if v is not None and v <= 1.0 else 'MISSED'} ({fmt(v, 2)} ms)"
            )
            v = facts.get(f"{g}.{api}.tok_ratio_c64")
            out.append(
                f"- {g}: /v1/{api} token rate at 64 streams ≥ 95% of direct: "
                f"{'met' if v is not None and v >= 0.95 else 'MISSED'} "
                f"({fmt(v * 100 if v else None, 1)}%)"
            )
        if facts.get(f"{g}.hold_ok") is not None:
            ok = facts[f"{g}.hold_errors"] == 0 and facts[f"{g}.hold_ok"] == hold
            out.append(
                f"- {g}: {hold:,} concurrent streams with no errors: {'met' if ok else 'MISSED'} "
                f"({facts[f'{g}.hold_ok']} ok, {facts[f'{g}.hold_errors']} errors; "
                f"workers' peak RSS {fmt(facts[f'{g}.hold_rss'], 0)} MB)"
            )
    return out


BEGIN, END = "<!-- gateway_bench.py --write: begin -->", "<!-- gateway_bench.py --write: end -->"


# A run with a TLS column writes its own section: it compares plain and TLS, not the
# full set of columns the gateway-overhead section holds.
TLS_SECTION = "## TLS front (HTTPS through Caddy)"


def write_section(block: str, section: str = SECTION) -> None:
    """Replace the generated block inside this bench's section (prose around it stays)."""
    begin, end = BEGIN, END
    if section != SECTION:  # a partial run's own block, beside the full run's
        title = section.removeprefix("## ")
        begin = BEGIN.replace("--write", f"--write [{title}]")
        end = END.replace("--write", f"--write [{title}]")
    replace_block(section, begin, end, block)


def replace_block(section: str, begin: str, end: str, block: str) -> None:
    """Put ``block`` between the markers ``begin`` and ``end`` in bench/RESULTS.md (the prose
    around them stays); without them, append ``section`` with the block at the end. Every
    bench with ``--write`` goes through here."""
    path = ROOT / "bench" / "RESULTS.md"
    page = path.read_text()
    generated = f"{begin}\n{block}{end}"
    if begin in page and end in page:
        page = page[: page.index(begin)] + generated + page[page.index(end) + len(end) :]
    else:
        page = page.rstrip("\n") + f"\n\n{section}\n\n{generated}\n"
    path.write_text(page)


# --- main --------------------------------------------------------------------------------------


def sh(cmd: list[str], **kw: object) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


def psql(sql: str) -> None:
    sh(["psql", f"{PG}/postgres", "-v", "ON_ERROR_STOP=1", "-q", "-c", sql])


def load_avg() -> str:
    return sh(["uptime"]).strip().split("load average:")[-1].strip()


@dataclass
class Stack:
    """Everything a run shares: simulators, database rows, the key, the load generator."""

    env: dict
    tmp: Path
    ports: dict[str, int]
    key: str
    load: Load
    servers: list[Server]


@contextlib.contextmanager
def bench_stack(db_name: str = DB_NAME) -> Iterator[Stack]:
    """Start simulators, a fresh database with the bench rows and a load generator; undo it all."""
    prefix = f"bench-{secrets.token_hex(4)}"
    tmp = Path(tempfile.mkdtemp(prefix="gwbench-"))
    env = {
        **os.environ,
        "TOLLGATE_ENV": "test",
        "DATABASE_URL": f"{PG}/{db_name}",
        "TOLLGATE_REDIS_PREFIX": prefix,
        "TOLLGATE_LOG_LEVEL": "WARNING",
    }
    servers: list[Server] = []
    load: Load | None = None
    db_made = False
    try:
        ports: dict[str, int] = {}
        for name, (tokens, tps) in SIMS.items():
            ports[name], sim = start_sim(name, tokens, tps)
            servers.append(sim)
        psql(f"DROP DATABASE IF EXISTS {db_name} WITH (FORCE)")
        psql(f"CREATE DATABASE {db_name}")
        db_made = True
        sh([PY, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=env)
        key = json.loads(
            sh(
                [PY, "bench/gateway_setup.py", *(f"{n}={p}" for n, p in ports.items())],
                cwd=ROOT,
                env=env,
            )
            .strip()
            .splitlines()[-1]
        )["key"]
        load = Load()
        yield Stack(env, tmp, ports, key, load, servers)
    finally:
        if load:
            load.stop()
        for srv in servers:
            srv.stop()
        if db_made:
            with contextlib.suppress(subprocess.CalledProcessError):
                psql(f"DROP DATABASE IF EXISTS {db_name} WITH (FORCE)")
        with contextlib.suppress(Exception):
            keys = sh(
                ["redis-cli", "--scan", "--pattern", f"{prefix}*"]
            ).split()  # and the columns' own
            for i in range(0, len(keys), 500):
                sh(["redis-cli", "del", *keys[i : i + 500]])
        if sys.exc_info()[0] is None:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"server logs kept in {tmp}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--write", action="store_true", help="replace the generated block in bench/RESULTS.md"
    )
    ap.add_argument(
        "--columns",
        default="direct,Tollgate w2 appliance,Tollgate w1,Tollgate w2,Tollgate w2 aiohttp,"
        "LiteLLM w1,LiteLLM w2",
        help="'Tollgate wN aiohttp': the gateway with TOLLGATE_UPSTREAM_CLIENT=aiohttp; "
        "'Tollgate wN tls': the gateway behind the appliance's TLS front (Caddy); "
        "'Tollgate wN appliance': web, worker, beat and usage consumer together; "
        "'Tollgate wN before': the gateway of the --before checkout",
    )
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every scenario's duration")
    ap.add_argument(
        "--before",
        type=Path,
        help="another checkout (e.g. `git worktree add /tmp/before <commit>`) whose gateway "
        "the columns named 'Tollgate wN before' run, beside this tree's: a change measured "
        "side by side on one machine",
    )
    ap.add_argument(
        "--db-name", default=DB_NAME, help="the throw-away database (dropped before and after)"
    )
    ap.add_argument("--hold", type=int, default=1000, help="concurrent streams held (0: skip)")
    ap.add_argument(
        "--hold-litellm", action="store_true", help="also hold the streams through LiteLLM"
    )
    ap.add_argument(
        "--section",
        default=SECTION,
        help="the bench/RESULTS.md section --write fills (a partial run: give it its own)",
    )
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cols = [c.strip() for c in a.columns.split(",")]
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load_before = load_avg()
    results: dict[str, dict[str, dict]] = {}
    if any(c.startswith("LiteLLM") for c in cols):
        ensure_litellm()
    with bench_stack(a.db_name) as st:
        for col in cols:
            print(f"{col} …", file=sys.stderr, flush=True)
            if col == "direct":
                column = Column(
                    col, {n: f"http://127.0.0.1:{p}" for n, p in st.ports.items()}, None, None
                )
            elif col.startswith("Tollgate") and col.endswith("appliance"):
                from gateway_appliance import start_appliance

                env = {
                    **st.env,
                    "TOLLGATE_REDIS_PREFIX": f"{st.env['TOLLGATE_REDIS_PREFIX']}-{len(results)}",
                }
                url, srv = start_appliance(workers_of(col), env, st.key, st.tmp)
                st.servers.append(srv)
                column = Column(col, dict.fromkeys(SIMS, url), st.key, srv)
            elif col.startswith("Tollgate"):
                # Each gateway column starts from empty Redis state, like a fresh appliance:
                # otherwise the previous column's 60-s rate windows, still full of its
                # thousands of requests per second, expire during this column and every
                # admission here pays for pruning them (+4 ms per stream at c=1, measured).
                env = {
                    **st.env,
                    "TOLLGATE_UPSTREAM_CLIENT": "aiohttp"
                    if col.endswith("aiohttp")
                    else "tollgate",
                    "TOLLGATE_REDIS_PREFIX": f"{st.env['TOLLGATE_REDIS_PREFIX']}-{len(results)}",
                }
                tree = a.before if col.endswith(" before") else ROOT
                if tree is None:
                    ap.error(f"column {col!r} needs --before PATH")
                log = st.tmp / "tollgate.log"
                url, srv = start_tollgate(workers_of(col), env, st.key, log, tree=tree)
                if col.endswith(" tls"):
                    url, st.load.ca, front = start_tls_front(
                        url, st.key, st.tmp, st.tmp / "caddy.log"
                    )
                    srv = Fronted(srv.proc, front=front)
                    srv.refresh()
                st.servers.append(srv)
                column = Column(col, dict.fromkeys(SIMS, url), st.key, srv)
            else:
                url, master, srv = start_litellm(
                    workers_of(col), st.ports, st.tmp, st.tmp / "litellm.log"
                )
                st.servers.append(srv)
                column = Column(col, dict.fromkeys(SIMS, url), master, srv)
            hold = (
                a.hold
                if (col.startswith("Tollgate") or (col.startswith("LiteLLM") and a.hold_litellm))
                else 0
            )
            results[col] = run_column(st.load, column, a.scale, hold)
            st.load.ca = None
            if column.server:
                column.server.stop()
                st.servers.remove(column.server)
    load_after = load_avg()
    text, facts = table(cols, results)
    lines = verdicts(facts, a.hold) + tls_verdicts(results)
    cmd = "$ .venv/bin/python bench/gateway_bench.py " + shlex.join(sys.argv[1:])
    machine = (
        f"`nproc` {os.cpu_count()}, `uname -m` {platform.machine()}, Python "
        f"{platform.python_version()}, "
        f"LiteLLM {LITELLM_VERSION}; {started}; load average before {load_before}, after "
        f"{load_after}"
    )
    print(f"\n{cmd.strip()}\n{machine}\n\n{text}\n\n" + "\n".join(lines))
    if a.write:
        section = a.section
        if section == SECTION and any(c.endswith(" tls") for c in cols):
            section = TLS_SECTION
        write_section(render_section(cmd.strip(), machine, text, lines), section)


def tls_verdicts(res: dict[str, dict[str, dict]]) -> list[str]:
    """The TLS front against the same gateway without it, measured in this run."""
    out = []
    for col in res:
        plain = col.removesuffix(" tls")
        if plain == col or plain not in res:
            continue
        for c in (1, 16, 64):
            s = f"stream c={c}"
            a, b = res[col].get(s, {}).get("tok_s"), res[plain].get(s, {}).get("tok_s")
            if a is None or not b:
                continue
            ratio = a / b
            out.append(
                f"- {col}: streaming token rate at c={c} within 10% of {plain}: "
                f"{'met' if ratio >= 0.9 else 'MISSED'} ({a:,.0f} vs {b:,.0f} tok/s = {ratio:.3f})"
            )
    return out


def workers_of(column: str) -> int:
    return int(column.split(" ")[1].removeprefix("w"))


def render_section(cmd: str, machine: str, text: str, lines: list[str]) -> str:
    return (
        f"Latest run: {machine}.\n\n```\n{cmd}\n```\n\n{text}\n\n"
        "Targets:\n\n" + "\n".join(lines) + "\n"
    )


if __name__ == "__main__":
    main()
