"""Admission and priority (issues 9 and 18): P0's time to first token under a P2 flood,
on engines that serve first come, first served and on engines that preempt by priority.

Per scheduling policy (``--policies fcfs,priority``), one simulator engine with
``--max-num-seqs 4`` and DGX-Spark-like timings (prefill 50 ms + 0.05 ms a prompt token,
30 tokens/s decode for one sequence, bandwidth alpha 0.15), behind Tollgate (gunicorn, 2
uvicorn workers) on a throw-away database (``tollgate_admbench``) and Redis prefix. The
deployment row says ``max-num-seqs 4`` and the policy, so the gateway's static budget is 4.
What beat would run is run by bench/admission_ticker.py: the engine scraper
(``deployments.fleet.scrape_all``, which P2 gating and the KV-cache token budget read) and
the adaptive ceiling (``gateway.tuning.tune_all``), both every 5 s as in beat
(``--no-scrape``, ``--no-tune`` to switch them off). Runs, each from an idle engine and a
fresh controller:

  unloaded    P0 tenant alone: 16-token streams at a steady ``--p0-rate`` (1/s)
  p2only      a P2 tenant with 32 clients back-to-back (64-128 tokens): the busy baseline
  priorities  the same P0 traffic + the P2 flood (P0 starts 5 s into the flood)
  flat        (``--runs``) run 3 with both tenants set to P1 (fair share only)
  fair        (``--runs``) two P1 tenants (weight 1 each), 32 clients back-to-back each

Every 50 ms a sampler reads the engine's ``vllm:num_requests_running|waiting`` and the
gateway's queue (ZCARD of ``<prefix>:adm:<model>:q``; P2 entries are the ones ranked
≥ 2e13) and ceiling. "Engine busy" = mean running / 4 over the P0 window; the target
compares it with the P2-only run's over the same window. Queue wait per class comes from
the gateway's own ``tollgate_queue_wait_seconds`` histogram (multiprocess mode).

    .venv/bin/python bench/admission_bench.py            # print the tables
    .venv/bin/python bench/admission_bench.py --write    # and replace its section in RESULTS.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gateway_bench import (
    PG,
    PY,
    ROOT,
    Server,
    fmt,
    free_port,
    load_avg,
    psql,
    replace_block,
    sh,
    wait_listening,
)

# Its own throw-away database; TOLLGATE_ADMBENCH_DB names another (benches run side by side).
DB_NAME = os.environ.get("TOLLGATE_ADMBENCH_DB", "tollgate_admbench")
MODEL = "bench-model"
SLOTS = 4
SECTION = "## Admission and priority"
BEGIN, END = (
    "<!-- admission_bench.py --write: begin -->",
    "<!-- admission_bench.py --write: end -->",
)
SIM_ARGS = [
    "--max-num-seqs",
    str(SLOTS),
    "--max-model-len",
    "4096",
    "--sim-load-seconds",
    "0",
    "--sim-ttft-ms",
    "50",
    "--sim-ttft-per-token-ms",
    "0.05",
    "--sim-decode-tps",
    "30",
    "--sim-bandwidth-alpha",
    "0.15",
    "--sim-output-tokens-min",
    "64",
    "--sim-output-tokens-max",
    "128",
]
P2_RANK = 2e13  # acquire.lua: rank = class * 1e13 + virtual start time
SAMPLE_SECONDS = 0.05
GAUGE = re.compile(
    r"^(vllm:num_requests_running|vllm:num_requests_waiting)\{[^}]*\} ([0-9.e+-]+)$", re.M
)


# --- processes ---------------------------------------------------------------------------------


def start_sim(policy: str, extra: tuple[str, ...] = ()) -> tuple[int, Server]:
    port = free_port()
    cmd = [
        PY,
        "-m",
        "engine_sim",
        MODEL,
        "--served-model-name",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *SIM_ARGS,
        "--scheduling-policy",
        policy,
        *extra,
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Server(proc)
    wait_listening(port, proc)
    return port, server


def start_gateway(env: dict, key: str, log: Path, workers: int) -> tuple[str, Server]:
    port = free_port()
    cmd = [
        PY,
        "-m",
        "gunicorn",
        "-c",
        "python:config.gunicorn",
        "config.asgi:application",
        "-w",
        str(workers),
        "-b",
        f"127.0.0.1:{port}",
        "--graceful-timeout",
        "5",
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "a")
    )
    server = Server(proc)
    wait_listening(port, proc)
    url = f"http://127.0.0.1:{port}"
    deadline, streak = time.monotonic() + 90, 0
    while streak < 8:  # several answers in a row: every worker is up
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"gateway did not come up (log: {log})")
        req = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                streak = streak + 1 if MODEL in {m["id"] for m in json.load(r)["data"]} else 0
        except OSError:
            streak = 0
        time.sleep(0.1)
    server.refresh()
    return url, server


class JsonProcess:
    """A helper process that talks JSON lines; its output is collected by a thread."""

    def __init__(self, cmd: list[str], env: dict | None = None) -> None:
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.early: list[dict] = []  # what it printed before it was ready
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{cmd[:3]} died before it was ready")
            message = json.loads(line)
            if message.get("ready"):
                break
            self.early.append(message)

    def ask(self, spec: dict) -> dict:
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.proc.args[:3]} died")
        return json.loads(line)

    def stop(self) -> list[dict]:
        """Close its stdin, wait for it, and return what it printed since start."""
        rest = list(self.early)
        try:
            out, _ = self.proc.communicate(timeout=15)  # closes stdin: the helper's cue to end
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        for line in (out or "").splitlines():
            with contextlib.suppress(ValueError):
                rest.append(json.loads(line))
        return rest


# --- sampling ----------------------------------------------------------------------------------


class Sampler(threading.Thread):
    """Every 50 ms: the engine's running/waiting and the gateway's queue and ceiling."""

    def __init__(
        self,
        engine_url: str,
        redis_client: object,
        prefix: str,
        model_id: int,
        every: float = SAMPLE_SECONDS,
    ) -> None:
        super().__init__(daemon=True)
        self.every = every
        self.url, self.r = engine_url + "/metrics", redis_client
        base = f"{prefix}:adm:{model_id}"
        self.queue, self.running, self.ceiling = f"{base}:q", f"{base}:run", f"{base}:ceiling"
        self.samples: list[tuple[float, float, float, int, int, int, int]] = []
        self.done = threading.Event()
        self.t0 = time.perf_counter()

    def run(self) -> None:
        while not self.done.is_set():
            tick = time.perf_counter()
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(self.url, timeout=2) as resp:
                    text = resp.read().decode()
                figures = {name: float(v) for name, v in GAUGE.findall(text)}
                pipe = self.r.pipeline(transaction=False)
                pipe.zcard(self.queue)
                pipe.zcount(self.queue, P2_RANK, "+inf")
                pipe.zcard(self.running)
                pipe.get(self.ceiling)
                queued, p2_queued, held, ceiling = pipe.execute()
                self.samples.append(
                    (
                        round(tick - self.t0, 3),
                        figures["vllm:num_requests_running"],
                        figures["vllm:num_requests_waiting"],
                        queued,
                        p2_queued,
                        held,
                        int(ceiling) if ceiling else 0,
                    )
                )
            self.done.wait(max(0.0, self.every - (time.perf_counter() - tick)))

    def stop(self) -> list[tuple]:
        self.done.set()
        self.join()
        return self.samples


def engine_counter(url: str, name: str) -> float:
    """The sum of one metric's samples on the engine's /metrics (e.g. tokens generated)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.partition("{")[0].partition(" ")[0] == name
    )


def gateway_queue_wait(url: str, token: str) -> dict[tuple[str, str], tuple[float, float]]:
    """(priority, tenant id) -> (seconds waited in all, requests) from the gateway's histogram;
    ("preempted", priority) -> (0, requests the gateway preempted)."""
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    out: dict[tuple[str, str], list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "tollgate_preemptions":
            for s in family.samples:
                if s.name.endswith("_total"):
                    key = ("preempted", s.labels.get("priority", ""))
                    out.setdefault(key, [0.0, 0.0])[1] += s.value
            continue
        if family.name != "tollgate_queue_wait_seconds":
            continue
        for s in family.samples:
            key = (s.labels.get("priority", ""), s.labels.get("tenant", ""))
            if s.name.endswith("_sum"):
                out.setdefault(key, [0.0, 0.0])[0] += s.value
            elif s.name.endswith("_count"):
                out.setdefault(key, [0.0, 0.0])[1] += s.value
    return {k: (v[0], v[1]) for k, v in out.items()}


# --- runs --------------------------------------------------------------------------------------


@dataclass
class Bench:
    env: dict
    tmp: Path
    gateway: str
    engine: str
    rows: dict
    redis: object
    load: JsonProcess
    metrics_token: str
    scrape: bool
    tune: bool
    servers: list[Server] = field(default_factory=list)
    sample_every: float = SAMPLE_SECONDS  # the sampler's period (a real engine: less often)
    # The whole appliance (web, worker, beat, usage consumer) runs: beat scrapes and tunes,
    # and the controller's ticks are read from its AdmissionSample rows, not a ticker.
    appliance: bool = False
    last_sample: int = 0

    def samples_since(self) -> list[dict]:
        """The controller ticks beat ran since the last call (the appliance's own)."""
        out = sh(
            [PY, "bench/admission_setup.py", "samples", str(self.last_sample)],
            cwd=ROOT,
            env=self.env,
        )
        found = json.loads(out.strip().splitlines()[-1])
        self.last_sample = found["last"]
        return found["ticks"]

    def wait_verdict(self, timeout: float = 150.0) -> None:
        """Until the controller has judged the gateway's preemption on the model: on a
        running appliance beat asked the idle engine long before any flood (gateway/tuning.py:
        at a tick that finds it idle, at most once a minute)."""
        key = f"{self.env['TOLLGATE_REDIS_PREFIX']}:adm:{self.rows['model_id']}:pfree"
        deadline = time.monotonic() + timeout
        while not self.redis.exists(key):
            if time.monotonic() > deadline:
                raise TimeoutError("the controller did not judge preemption on the idle engine")
            time.sleep(0.5)

    def reset_admission(self) -> None:
        """A fresh controller (ceiling back to the static budget) and fair-share clock."""
        base = f"{self.env['TOLLGATE_REDIS_PREFIX']}:adm:{self.rows['model_id']}"
        self.redis.delete(f"{base}:ctl", f"{base}:ceiling", f"{base}:vft")

    def wait_idle(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        base = f"{self.env['TOLLGATE_REDIS_PREFIX']}:adm:{self.rows['model_id']}"
        while time.monotonic() < deadline:
            with urllib.request.urlopen(self.engine + "/metrics", timeout=2) as r:
                figures = {n: float(v) for n, v in GAUGE.findall(r.read().decode())}
            if (
                not any(figures.values())
                and not self.redis.zcard(f"{base}:q")
                and not self.redis.zcard(f"{base}:run")
            ):
                return
            time.sleep(0.2)
        raise TimeoutError("engine or gateway queue did not drain")

    def run(self, name: str, groups: dict, duration: float, url: str | None = None) -> dict:
        """One scenario through the gateway (or straight to ``url``, e.g. the engine)."""
        self.wait_idle()
        self.reset_admission()
        ticker = None
        if self.appliance:
            self.wait_verdict()
            self.samples_since()  # only this run's ticks are read afterwards
        else:
            flags = [f for f, on in (("--scrape", self.scrape), ("--tune", self.tune)) if on]
            ticker = JsonProcess(
                [PY, str(ROOT / "bench" / "admission_ticker.py"), *flags], env=self.env
            )
            # Its first tick may have asked the idle engine a question (gateway/tuning.py's
            # abort check): the scenario starts once the engine is idle again.
            self.wait_idle()
        waits0 = gateway_queue_wait(self.gateway, self.metrics_token)
        sampler = Sampler(
            self.engine,
            self.redis,
            self.env["TOLLGATE_REDIS_PREFIX"],
            self.rows["model_id"],
            self.sample_every,
        )
        sampler.start()
        generated0 = engine_counter(self.engine, "vllm:generation_tokens_total")
        spec = {
            "url": url or self.gateway,
            "duration": duration,
            "groups": {
                g: {**s, "model": MODEL, "key": self.rows["keys"][g]} for g, s in groups.items()
            },
        }
        print(f"{name} …", file=sys.stderr, flush=True)
        result = self.load.ask(spec)
        samples = sampler.stop()
        ticks = ticker.stop() if ticker else self.samples_since()
        waits1 = gateway_queue_wait(self.gateway, self.metrics_token)
        result["generated"] = (
            engine_counter(self.engine, "vllm:generation_tokens_total") - generated0
        )
        result["samples"] = samples
        result["ticks"] = [t for t in ticks if "ceiling" in t]
        result["queue_wait"] = {
            f"{p}/{t}": (
                waits1[(p, t)][0] - waits0.get((p, t), (0, 0))[0],
                waits1[(p, t)][1] - waits0.get((p, t), (0, 0))[1],
            )
            for (p, t) in waits1
        }
        return result


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def ttft_stats(result: dict, group: str) -> dict:
    if group not in result["groups"]:  # e.g. the P2-only run has no P0 traffic
        return dict.fromkeys(("n", "ok", "errors", "p50", "p90", "p99", "mean"), None) | {
            "classes": [],
            "first_error": "",
        }
    reqs = result["groups"][group]["requests"]
    ok = [r for r in reqs if r[4] == 200 and r[1] is not None]
    ttft = [r[1] * 1000 for r in ok]
    return {
        "n": len(reqs),
        "ok": len(ok),
        "errors": len(reqs) - len(ok),
        "p50": percentile(ttft, 0.5),
        "p90": percentile(ttft, 0.9),
        "p99": percentile(ttft, 0.99),
        "mean": sum(ttft) / len(ttft) if ttft else None,
        "classes": sorted({r[5] for r in reqs if r[5]}),
        "first_error": result["groups"][group]["first_error"],
    }


def engine_stats(result: dict, start: float, end: float, p2_only: bool) -> dict:
    """Utilisation and idle gaps over [start, end) seconds of the run."""
    rows = [s for s in result["samples"] if start <= s[0] < end]
    if not rows:
        return {}
    waiting = [s for s in rows if (s[4] if p2_only else s[3]) > 0]
    idle = [s for s in waiting if s[1] < SLOTS]
    # Gaps: consecutive idle-while-waiting samples. One sample (under 100 ms) is a slot handing
    # over (settle, wake, forward); longer ones are slots left empty.
    gaps, run = [], 0
    for s in rows:
        if (s[4] if p2_only else s[3]) > 0 and s[1] < SLOTS:
            run += 1
        elif run:
            gaps, run = [*gaps, run], 0
    gaps += [run] if run else []
    return {
        "samples": len(rows),
        "util": sum(min(s[1], SLOTS) for s in rows) / (SLOTS * len(rows)),
        "waiting_samples": len(waiting),
        "idle_while_waiting": len(idle) / len(waiting) if waiting else None,
        "long_gaps": sum(1 for g in gaps if g >= 2),
        "longest_gap_s": max(gaps, default=0) * SAMPLE_SECONDS,
        "idle_in_long_gaps_s": sum(g for g in gaps if g >= 2) * SAMPLE_SECONDS,
        "engine_queue": sum(1 for s in rows if s[2] > 0) / len(rows),
        "gateway_queue_mean": sum(s[3] for s in rows) / len(rows),
    }


def tokens_between(result: dict, group: str, start: int, end: int) -> int:
    per = result["groups"][group]["per_second"]
    return sum(v for k, v in per.items() if start <= int(k) < end)


def preempted(result: dict) -> str:
    parts = [
        f"{label.split('/')[1]} × {count:.0f}"
        for label, (_, count) in sorted(result["queue_wait"].items())
        if label.startswith("preempted/") and count
    ]
    return ", ".join(parts) or "none"


def mean_wait(result: dict, tenant_id: int) -> str:
    parts = []
    for label, (total, count) in sorted(result["queue_wait"].items()):
        if label.endswith(f"/{tenant_id}") and count:
            parts.append(f"{label.split('/')[0]} {total / count * 1000:,.0f} ms × {count:.0f}")
    return ", ".join(parts) or "–"


def ceilings(result: dict) -> str:
    ticks = result["ticks"]
    if not ticks:
        return "–"
    return " ".join(f"{t['ceiling']}{t['decision'][0]}" for t in ticks)


# --- report ------------------------------------------------------------------------------------


def report(
    res: dict,
    rows: dict,
    p0_window: tuple[float, float],
    fair_window: tuple[int, int],
    p0_rate: float,
) -> tuple[str, list[str], list[str]]:
    base = ttft_stats(res["unloaded"], "interactive")
    lines = [
        "| run | P0 TTFT p50 / p90 / p99, ms | p50 / p99 vs unloaded | P0 ok / err | P0 mean "
        "queue wait "
        "| engine busy (running/4) | idle while P2 waits | gaps of 2+ samples: count, idle s, "
        "longest s "
        "| engine queue > 0 | P2 tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    facts: dict[str, object] = {}
    ids = rows["tenant_ids"]
    for name, label in (
        ("unloaded", f"1 P0 alone ({p0_rate:g}/s, 16 tok)"),
        ("p2only", "2 P2 flood alone (32 clients)"),
        ("priorities", "3 P0 + P2 flood"),
        ("flat", "4 same, classes off (both P1)"),
    ):
        if name not in res:
            continue
        r = res[name]
        st = ttft_stats(r, "interactive")
        eng = (
            engine_stats(r, *p0_window, p2_only=name in ("priorities", "p2only"))
            if name != "unloaded"
            else engine_stats(r, 0, 1e9, p2_only=False)
        )
        ratio = (
            f"{st['p50'] / base['p50']:.2f}× / {st['p99'] / base['p99']:.2f}×"
            if st["p50"] and base["p50"]
            else "–"
        )
        p2tok = "–"
        if "batch" in r["groups"]:
            p2tok = fmt(
                tokens_between(r, "batch", int(p0_window[0]), int(p0_window[1]))
                / (p0_window[1] - p0_window[0]),
                1,
            )
        idle = eng.get("idle_while_waiting")
        lines.append(
            f"| {label} | {fmt(st['p50'], 0)} / {fmt(st['p90'], 0)} / {fmt(st['p99'], 0)} | "
            f"{ratio} | "
            f"{fmt(st['ok'], 0)} / {fmt(st['errors'], 0)} | {mean_wait(r, ids['interactive'])} | "
            f"{fmt(eng.get('util', 0) * 100, 1)}% | "
            f"{fmt(idle * 100 if idle is not None else None, 1)}% of "
            f"{eng.get('waiting_samples', 0)} | "
            f"{eng.get('long_gaps', 0)}, {fmt(eng.get('idle_in_long_gaps_s', 0), 2)}, "
            f"{fmt(eng.get('longest_gap_s', 0), 2)} | "
            f"{fmt(eng.get('engine_queue', 0) * 100, 1)}% | {p2tok} |"
        )
        facts[name] = {"ttft": st, "engine": eng}
    extra = []
    for name in ("priorities", "flat", "fair"):
        if name in res:
            extra.append(
                f"- ceiling each 5 s tick in run {name} (i increase, d decrease, h hold): "
                f"{ceilings(res[name])}"
            )
            st = (
                ttft_stats(res[name], "interactive")
                if "interactive" in res[name]["groups"]
                else None
            )
            if st and st["classes"]:
                extra.append(
                    f"- run {name}: the gateway put the P0 tenant's requests in "
                    f"{', '.join(st['classes'])}, "
                    f"the flood's in {', '.join(ttft_stats(res[name], 'batch')['classes'])}; "
                    f"flood queue wait {mean_wait(res[name], ids['batch'])}; "
                    f"requests the gateway preempted: {preempted(res[name])}"
                )
    verdict = []
    if "priorities" in facts:
        st = facts["priorities"]["ttft"]
        p50r, p99r = st["p50"] / base["p50"], st["p99"] / base["p99"]
        verdict.append(
            f"- P0 TTFT under the P2 flood within 20% of unloaded at p50 and within 2× at p99: "
            f"{'met' if p50r <= 1.2 and p99r <= 2.0 else 'MISSED'} "
            f"(p50 {fmt(st['p50'], 0)} vs {fmt(base['p50'], 0)} ms = {p50r:.2f}×, "
            f"p99 {fmt(st['p99'], 0)} vs {fmt(base['p99'], 0)} ms = {p99r:.2f}×)"
        )
    if "priorities" in facts and "p2only" in facts:
        busy = facts["priorities"]["engine"].get("util", 0)
        alone = facts["p2only"]["engine"].get("util", 0)
        ratio = busy / alone if alone else 0
        verdict.append(
            f"- engine busy with P0 + P2 ≥ 95% of its busy fraction with P2 alone (same "
            f"window): {'met' if ratio >= 0.95 else 'MISSED'} "
            f"({busy * 100:.1f}% vs {alone * 100:.1f}% = {ratio * 100:.1f}%)"
        )
    if "fair" in res:
        r = res["fair"]
        a, b = (tokens_between(r, g, *fair_window) for g in ("fair-a", "fair-b"))
        whole_a, whole_b = (
            sum(r["groups"][g]["per_second"].values()) for g in ("fair-a", "fair-b")
        )
        ratio = min(a, b) / max(a, b) if max(a, b) else 0
        eng = engine_stats(r, *fair_window, p2_only=False)
        lines += [
            "",
            "| fair share: two P1 tenants, weight 1, 32 clients each | fair-a | fair-b | ratio |",
            "|---|---:|---:|---:|",
            f"| tokens received, seconds {fair_window[0]}–{fair_window[1]} | {a:,} | {b:,} | "
            f"{ratio:.3f} |",
            f"| tokens received, whole run | {whole_a:,} | {whole_b:,} | "
            f"{min(whole_a, whole_b) / max(whole_a, whole_b, 1):.3f} |",
            "| requests completed / refused | "
            f"{sum(1 for q in r['groups']['fair-a']['requests'] if q[4] == 200)}"
            f" / {sum(1 for q in r['groups']['fair-a']['requests'] if q[4] != 200)} | "
            f"{sum(1 for q in r['groups']['fair-b']['requests'] if q[4] == 200)} / "
            f"{sum(1 for q in r['groups']['fair-b']['requests'] if q[4] != 200)} | |",
            f"| mean queue wait | {mean_wait(r, ids['fair-a'])} | {mean_wait(r, ids['fair-b'])} | "
            "|",
            f"| engine busy (running/4) in the window | {eng.get('util', 0) * 100:.1f}% | | |",
        ]
        verdict.append(
            "- fair share: equal-weight P1 tenants within 10% of each other's tokens under "
            "saturation: "
            f"{'met' if ratio >= 0.9 else 'MISSED'} ({a:,} vs {b:,} tokens, ratio {ratio:.3f})"
        )
    return "\n".join(lines), extra, verdict


def write_section(block: str) -> None:
    """Replace this bench's generated block in bench/RESULTS.md."""
    replace_block(SECTION, BEGIN, END, block)


# --- main --------------------------------------------------------------------------------------


@contextlib.contextmanager
def bench(
    workers: int,
    scrape: bool,
    tune: bool,
    policy: str,
    engine: Callable[[], tuple[int, object]] | None = None,
    extra_env: dict | None = None,
    appliance: bool = False,
):
    """Engine, database, tenants and gateway for one series of runs. ``engine`` starts the
    engine (its loopback port and something with ``stop()``; default: the simulator with
    ``SIM_ARGS``); ``extra_env`` goes to the gateway and the ticker. ``appliance``: the
    whole appliance as it really runs (bench/gateway_appliance.py: web with production
    settings, worker, beat, usage consumer) instead of the gateway and the ticker."""
    import redis

    prefix = f"admbench-{secrets.token_hex(4)}"
    tmp = Path(tempfile.mkdtemp(prefix="admbench-"))
    (tmp / "prom").mkdir()
    token = secrets.token_urlsafe(16)
    env = {
        **os.environ,
        "TOLLGATE_ENV": "test",
        "DATABASE_URL": f"{PG}/{DB_NAME}",
        "TOLLGATE_REDIS_PREFIX": prefix,
        "TOLLGATE_LOG_LEVEL": "WARNING",
        "TOLLGATE_METRICS_TOKEN": token,
        "PROMETHEUS_MULTIPROC_DIR": str(tmp / "prom"),
        **(extra_env or {}),
    }
    client = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    servers: list[Server] = []
    load: JsonProcess | None = None
    db_made = False
    try:
        port, sim = engine() if engine else start_sim(policy)
        servers.append(sim)
        psql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        psql(f"CREATE DATABASE {DB_NAME}")
        db_made = True
        sh([PY, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=env)
        rows = json.loads(
            sh([PY, "bench/admission_setup.py", "create", str(port), policy], cwd=ROOT, env=env)
            .strip()
            .splitlines()[-1]
        )
        if appliance:
            from gateway_appliance import start_appliance

            key = rows["keys"]["interactive"]
            url, gw = start_appliance(workers, env, key, tmp, frozenset({MODEL}))
        else:
            url, gw = start_gateway(env, rows["keys"]["interactive"], tmp / "gateway.log", workers)
        servers.append(gw)
        load = JsonProcess([PY, str(ROOT / "bench" / "admission_load.py")])
        yield Bench(
            env,
            tmp,
            url,
            f"http://127.0.0.1:{port}",
            rows,
            client,
            load,
            token,
            scrape,
            tune,
            servers,
            appliance=appliance,
        )
    finally:
        if load:
            with contextlib.suppress(Exception):
                load.stop()
        for srv in reversed(servers):
            with contextlib.suppress(Exception):
                srv.stop()
        if db_made:
            with contextlib.suppress(subprocess.CalledProcessError):
                psql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        with contextlib.suppress(Exception):
            keys = list(client.scan_iter(f"{prefix}:*", count=1000))
            for i in range(0, len(keys), 500):
                client.delete(*keys[i : i + 500])
        if sys.exc_info()[0] is None:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"server logs kept in {tmp}", file=sys.stderr)


def run_policy(a: argparse.Namespace, policy: str, runs: list[str]) -> tuple[dict, dict]:
    """Every run of one scheduling policy, on its own engine, database and gateway."""
    count = int(a.seconds * a.p0_rate)
    warm = 5.0  # the flood fills the engine and the queue before P0 traffic starts
    p0 = {"rate": a.p0_rate, "count": count, "max_tokens": 16}
    flood = {"concurrency": 32, "max_tokens_range": [64, 128]}
    fair_window = (10, int(a.seconds + 10))
    res: dict[str, dict] = {}
    with bench(a.workers, not a.no_scrape, not a.no_tune, policy) as b:
        # Warm-up: imports, pools and the engine's first-request path.
        b.load.ask(
            {
                "url": b.gateway,
                "duration": 3,
                "groups": {
                    "interactive": {
                        **p0,
                        "count": 4,
                        "model": MODEL,
                        "key": b.rows["keys"]["interactive"],
                    }
                },
            }
        )
        if "unloaded" in runs:
            res["unloaded"] = b.run(f"{policy}: unloaded", {"interactive": p0}, a.seconds + 1)
        if "p2only" in runs:
            res["p2only"] = b.run(f"{policy}: P2 alone", {"batch": flood}, warm + a.seconds + 1)
        if "priorities" in runs:
            res["priorities"] = b.run(
                f"{policy}: priorities",
                {"interactive": {**p0, "delay": warm}, "batch": flood},
                warm + a.seconds + 1,
            )
        if "flat" in runs:
            sh(
                [PY, "bench/admission_setup.py", "priorities", "interactive=P1", "batch=P1"],
                cwd=ROOT,
                env=b.env,
            )
            time.sleep(3)  # the gateway reloads its snapshot on the change notice
            res["flat"] = b.run(
                f"{policy}: classes off",
                {"interactive": {**p0, "delay": warm}, "batch": flood},
                warm + a.seconds + 1,
            )
            sh(
                [PY, "bench/admission_setup.py", "priorities", "interactive=P0", "batch=P2"],
                cwd=ROOT,
                env=b.env,
            )
        if "fair" in runs:
            res["fair"] = b.run(
                f"{policy}: fair share", {"fair-a": flood, "fair-b": flood}, fair_window[1]
            )
        rows = b.rows
    return res, rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--write", action="store_true", help="replace the generated block in bench/RESULTS.md"
    )
    ap.add_argument("--workers", type=int, default=2, help="gunicorn workers of the gateway")
    ap.add_argument(
        "--no-scrape", action="store_true", help="no engine scraper: P2 is not gated on telemetry"
    )
    ap.add_argument(
        "--no-tune", action="store_true", help="no adaptive ceiling: the static budget of 4"
    )
    ap.add_argument(
        "--seconds",
        type=float,
        default=100.0,
        help="P0 traffic per run (100 requests at 1/s: p99 is not the one worst)",
    )
    ap.add_argument("--p0-rate", type=float, default=1.0, help="P0 requests per second")
    ap.add_argument(
        "--policies",
        default="fcfs,priority",
        help="engine scheduling policies to run, each on its own engine",
    )
    ap.add_argument("--runs", default="unloaded,p2only,priorities")
    ap.add_argument(
        "--from-raw", type=Path, help="report the raw results of an earlier run, run nothing"
    )
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    runs = a.runs.split(",")
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load_before = load_avg()
    warm = 5.0
    p0_window = (warm, warm + a.seconds)
    fair_window = (10, int(a.seconds + 10))
    blocks, raw = [], {}
    dump = Path(tempfile.gettempdir()) / "admission-bench-raw.json"
    earlier = json.loads(a.from_raw.read_text()) if a.from_raw else {}
    for policy in a.policies.split(","):
        if a.from_raw:
            res, rows = earlier[policy]["res"], earlier[policy]["rows"]
        else:
            res, rows = run_policy(a, policy, runs)
            raw[policy] = {"res": res, "rows": rows}
            dump.write_text(json.dumps(raw))  # before the report: nothing measured is lost
        text, extra, verdict = report(res, rows, p0_window, fair_window, a.p0_rate)
        blocks.append(
            f"### Engines scheduling `{policy}`\n\n{text}\n\n"
            + "\n".join(extra)
            + "\n\nTargets:\n\n"
            + "\n".join(verdict)
            + "\n"
        )
    load_after = load_avg()
    cmd = "$ .venv/bin/python bench/admission_bench.py " + " ".join(sys.argv[1:])
    machine = (
        f"`nproc` {os.cpu_count()}, `uname -m` {platform.machine()}, Python "
        f"{platform.python_version()}; "
        f"{started}; gateway `gunicorn -w {a.workers}`; scraper "
        f"{'off' if a.no_scrape else 'on (5 s)'}, "
        f"adaptive ceiling {'off' if a.no_tune else 'on (5 s)'}; P0 {a.p0_rate:g} requests/s; "
        f"load average before {load_before}, after {load_after}"
    )
    out = f"{cmd.strip()}\n{machine}\n\n" + "\n".join(blocks)
    print("\n" + out)
    print(f"\nraw results and samples: {dump}", file=sys.stderr)
    if a.write:
        write_section(f"Latest run: {machine}.\n\n```\n{cmd.strip()}\n```\n\n" + "\n".join(blocks))


if __name__ == "__main__":
    main()
