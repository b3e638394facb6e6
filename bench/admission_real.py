"""Admission on the real engine (issue 27): P0's time to first token under a P2 flood, with
vLLM itself behind Tollgate, against the yardstick of the same engine with a free slot.

One ``tollgate/vllm-cpu`` container (``scripts/build-images vllm-cpu``) serving the
repository's test model (``scripts/make-test-model``, the volume ``$VLLM_TEST_MODELS``; vLLM's
compile cache in ``$VLLM_TEST_COMPILE``) as ``bench-model`` with ``--max-num-seqs 4`` and
``--scheduling-policy priority`` (the ``cpu`` profile's), published on a loopback port, in
front of the whole appliance as it runs (bench/gateway_appliance.py: web with production
settings, worker, beat with its engine scraper and adaptive ceiling every 5 s, usage
consumer). The database, tenants, sampler and load generator are bench/admission_bench.py's.
P2 jobs ask for 600 tokens
(``ignore_eos``); P0 asks for 16-token streams at 1/s, starting 5 s into the flood. The P2
clients are closed loops that stop at the end and let what they have out finish, so the
engine's generated tokens (``vllm:generation_tokens_total``) can be compared with the tokens
its clients received (the usage of every reply). Runs, each from an idle engine:

  yardstick         3 non-streaming P2 jobs sent straight to the engine (a slot always
                    free, nothing queued) and the P0 traffic, also straight to the engine
  flood             12 non-streaming P2 jobs through Tollgate, P0 through Tollgate
  yardstick-stream  as yardstick, the 3 jobs streaming
  flood-stream      12 streaming P2 jobs through Tollgate, P0 through Tollgate

Each flood is held to the yardstick of its own kind of job (the issue's "3 such jobs"): on
a CPU engine, streaming 600 tokens costs the engine's API process (and every relay) CPU
time that the model's forward passes then lack, with or without Tollgate.

The CPU engine's P0 times are bimodal on two cores (tens of ms, or a second and more when
its API process holds a stream's frames back), and which mode the median falls in moved
between runs of unchanged code (a yardstick's p50 22 ms in one run, 536 ms in the next).
So each flood and its yardstick run in turns (``--rounds``, the order swapped every other
round), meeting the same drift; P0's requests of every round are pooled, and each round's
own ratio is reported beside the pooled one.

Then, on the simulator (``--sim-finish-abandoned``: an engine that finishes a request whose
client left, as some engines do; vLLM aborts them), the same flood with the gateway's
preemption on and with it off (``TOLLGATE_ADMISSION_PREEMPT_FCFS=0``), each on its own
gateway: on such an engine preemption frees no slot, the controller's verdict must switch it
off, and P0 must do no worse than with it off.

    .venv/bin/python bench/admission_real.py            # print the tables
    .venv/bin/python bench/admission_real.py --write    # and replace its section in RESULTS.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import signal
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from admission_bench import (
    MODEL,
    bench,
    engine_stats,
    percentile,
    start_sim,
)
from gateway_bench import load_avg, replace_block

VLLM_IMAGE = os.environ.get("VLLM_CPU_IMAGE", "tollgate/vllm-cpu:0.32.0")
MODEL_VOLUME = os.environ.get("VLLM_TEST_MODELS", "tollgate-test-vllm-models")
COMPILE_VOLUME = os.environ.get("VLLM_TEST_COMPILE", "tollgate-test-vllm-compile")
TEST_MODEL = "tollgate-test/tiny-llama"  # what scripts/make-test-model stages
SLOTS = 4
JOB_TOKENS = 600
SECTION = "## Admission on the real engine"
BEGIN, END = (
    "<!-- admission_real.py --write: begin -->",
    "<!-- admission_real.py --write: end -->",
)


class VllmContainer:
    """The engine container; ``stop()`` removes it."""

    def __init__(self, policy: str) -> None:
        import docker

        self.container = docker.from_env().containers.run(
            VLLM_IMAGE,
            [
                TEST_MODEL,
                "--served-model-name",
                MODEL,
                "--max-model-len",
                "2048",
                "--max-num-seqs",
                str(SLOTS),
                "--scheduling-policy",
                policy,
            ],
            name=f"admreal-vllm-{uuid.uuid4().hex[:8]}",
            detach=True,
            environment={"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
            ports={"8000/tcp": ("127.0.0.1", None)},
            shm_size="1g",
            volumes={
                MODEL_VOLUME: {"bind": "/root/.cache/huggingface", "mode": "rw"},
                COMPILE_VOLUME: {"bind": "/root/.cache/vllm", "mode": "rw"},
            },
        )
        self.container.reload()
        self.port = int(self.container.attrs["NetworkSettings"]["Ports"]["8000/tcp"][0]["HostPort"])

    def wait_ready(self, timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.container.reload()
            if self.container.status != "running":
                raise RuntimeError(self.container.logs(tail=40).decode(errors="replace"))
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            time.sleep(1)
        raise TimeoutError("vLLM did not become healthy")

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.container.remove(force=True)


def start_vllm(policy: str) -> tuple[int, VllmContainer]:
    engine = VllmContainer(policy)
    try:
        engine.wait_ready()
    except BaseException:
        engine.stop()
        raise
    return engine.port, engine


def start_abandoning_sim(policy: str) -> tuple[int, object]:
    return start_sim(policy, ("--sim-finish-abandoned",))


def warm_up(b: object) -> None:
    """Imports, pools, the engine's first-request path (and vLLM's first compiles); first,
    as on an appliance that has run a while, the controller's verdict on preemption."""
    b.wait_verdict()
    b.load.ask(
        {
            "url": b.gateway,
            "duration": 30,
            "groups": {
                "interactive": {
                    "rate": 1.0,
                    "count": 4,
                    "max_tokens": 16,
                    "model": MODEL,
                    "key": b.rows["keys"]["interactive"],
                },
                "batch": {
                    "concurrency": SLOTS,
                    "max_tokens": 64,
                    "stream": False,
                    "drain": True,
                    "model": MODEL,
                    "key": b.rows["keys"]["batch"],
                },
            },
        }
    )


def flood(jobs: int, stream: bool) -> dict:
    return {"concurrency": jobs, "max_tokens": JOB_TOKENS, "stream": stream, "drain": True}


def summary(result: dict, p0_window: tuple[float, float]) -> dict:
    p0 = result["groups"]["interactive"]["requests"]
    p2 = result["groups"]["batch"]["requests"]
    ok0 = [r for r in p0 if r[4] == 200 and r[1] is not None]
    ttft = [r[1] * 1000 for r in ok0]
    ok2 = [r for r in p2 if r[4] == 200]
    received = sum(r[3] for r in ok0 + ok2)
    eng = engine_stats(result, *p0_window, p2_only=False)
    p0_waits = [0.0, 0.0]
    for label, (seconds, count) in result["queue_wait"].items():
        if label.startswith("P0/"):
            p0_waits[0] += seconds
            p0_waits[1] += count
    return {
        "ttfts": ttft,
        "p0_n": len(p0),
        "p0_ok": len(ok0),
        "p50": percentile(ttft, 0.5),
        "p90": percentile(ttft, 0.9),
        "p2_n": len(p2),
        "p2_ok": len(ok2),
        "p2_short": sum(1 for r in ok2 if r[3] != JOB_TOKENS),
        "p2_latency": sum(r[2] for r in ok2) / len(ok2) if ok2 else None,
        "p2_seconds": sum(r[2] for r in ok2),
        "received": received,
        "generated": result["generated"],
        "ratio": result["generated"] / received if received else None,
        "busy": eng.get("util"),
        "preempted": sum(
            count
            for label, (_, count) in result["queue_wait"].items()
            if label.startswith("preempted/")
        ),
        # P0 requests that waited in the gateway's queue for a slot, and how long on average
        # (tollgate_queue_wait_seconds observes only requests that queued).
        "p0_queued": p0_waits[1],
        "p0_queue_ms": p0_waits[0] / p0_waits[1] * 1000 if p0_waits[1] else None,
        # The ceiling admission used at each controller tick (slots, the adaptive controller's
        # less those held by requests an engine runs on after the gateway let them go).
        "ceilings": [t.get("ceiling") for t in result["ticks"]],
        "errors": "; ".join(
            g["first_error"] for g in result["groups"].values() if g.get("first_error")
        ),
    }


def pooled(rounds: list[dict]) -> dict:
    """One kind of run's rounds as one: P0's percentiles over every round's requests, the
    counts summed, and each round's own p50 kept (``round_p50s``)."""
    ttft = [t for r in rounds for t in r["ttfts"]]
    total = {k: sum(r[k] for r in rounds) for k in SUMMED}
    waits = sum((r["p0_queue_ms"] or 0) * r["p0_queued"] for r in rounds)
    busy = [r["busy"] for r in rounds if r["busy"] is not None]
    return {
        **total,
        "ttfts": ttft,
        "p50": percentile(ttft, 0.5),
        "p90": percentile(ttft, 0.9),
        "p2_latency": total["p2_seconds"] / total["p2_ok"] if total["p2_ok"] else None,
        "ratio": total["generated"] / total["received"] if total["received"] else None,
        "busy": sum(busy) / len(busy) if busy else None,
        "p0_queue_ms": waits / total["p0_queued"] if total["p0_queued"] else None,
        "ceilings": [c for r in rounds for c in r["ceilings"]],
        "errors": "; ".join(r["errors"] for r in rounds if r["errors"]),
        "round_p50s": [r["p50"] for r in rounds],
    }


SUMMED = (
    "p0_n",
    "p0_ok",
    "p2_n",
    "p2_ok",
    "p2_short",
    "p2_seconds",
    "received",
    "generated",
    "preempted",
    "p0_queued",
)


def round_ratios(run: dict, yard: dict) -> list[float]:
    """Each round's P0 p50 ÷ the yardstick's p50 in the same round."""
    return [f / y for f, y in zip(run["round_p50s"], yard["round_p50s"], strict=False) if f and y]


def fmt_ms(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f}"


def table(rows: list[tuple[str, str, dict]], yards: dict[str, float | None]) -> list[str]:
    """The runs' rows; ``yards`` gives each run's yardstick p50 (None: no ratio)."""
    lines = [
        "| run | sent to | P0 ok/sent | P0 TTFT p50 ms | p90 ms | p50 ÷ yardstick "
        "| P0 queued (mean wait ms) | P2 done (short) | P2 mean s | engine busy | generated "
        "| received | ratio | preempted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, where, s in rows:
        yard = yards.get(name)
        over = f"{s['p50'] / yard:.2f}×" if yard and s["p50"] else "—"
        lines.append(
            f"| {name} | {where} | {s['p0_ok']}/{s['p0_n']} | {fmt_ms(s['p50'])} "
            f"| {fmt_ms(s['p90'])} | {over} "
            f"| {s.get('p0_queued', 0):.0f} ({fmt_ms(s.get('p0_queue_ms'))}) "
            f"| {s['p2_ok']} ({s['p2_short']}) "
            f"| {s['p2_latency']:.1f} | {(s['busy'] or 0) * 100:.0f}% | {s['generated']:,.0f} "
            f"| {s['received']:,} | {s['ratio']:.4f} | {s['preempted']:.0f} |"
        )
    return lines


PAIRS = (("yardstick", "flood"), ("yardstick-stream", "flood-stream"))


def real_series(a: argparse.Namespace, p0: dict, window: tuple) -> dict:
    """Each flood and its yardstick in turns (``--rounds``; the order swapped every other
    round), so both meet the same drift of a noisy machine; the rounds are pooled."""
    out: dict[str, list[dict]] = {}
    p0 = {**p0, "count": int(a.seconds / a.rounds)}
    window = (a.warm, a.warm + a.seconds / a.rounds)
    with bench(
        a.workers,
        True,
        True,
        a.policy,
        engine=lambda: start_vllm(a.policy),
        extra_env={},
        appliance=True,
    ) as b:
        b.sample_every = 0.25  # vLLM's /metrics costs the engine's API process CPU time
        warm_up(b)
        duration = a.warm + a.seconds / a.rounds
        runs = {
            "yardstick": ({"interactive": p0, "batch": flood(3, False)}, b.engine),
            "flood": ({"interactive": p0, "batch": flood(12, False)}, None),
            "yardstick-stream": ({"interactive": p0, "batch": flood(3, True)}, b.engine),
            "flood-stream": ({"interactive": p0, "batch": flood(12, True)}, None),
        }
        for turn in range(a.rounds):
            for pair in PAIRS:
                for name in pair if turn % 2 == 0 else pair[::-1]:
                    if name not in a.runs:
                        continue
                    groups, url = runs[name]
                    print(f"real engine: {name}, round {turn + 1} …", file=sys.stderr, flush=True)
                    got = summary(b.run(name, groups, duration, url=url), window)
                    out.setdefault(name, []).append(got)
                    print(json.dumps({k: v for k, v in got.items() if k != "ttfts"}),
                          file=sys.stderr, flush=True)  # fmt: skip
    return {name: pooled(rounds) for name, rounds in out.items()}


def abandon_series(a: argparse.Namespace, p0: dict, window: tuple) -> dict:
    out = {}
    for name, env in (
        ("preemption on", {}),
        ("preemption off", {"TOLLGATE_ADMISSION_PREEMPT_FCFS": "0"}),
    ):
        with bench(
            a.workers,
            True,
            True,
            a.policy,
            engine=lambda: start_abandoning_sim(a.policy),
            extra_env=env,
            appliance=True,
        ) as b:
            warm_up(b)
            print(f"finish-abandoned simulator: {name} …", file=sys.stderr, flush=True)
            result = b.run(name, {"interactive": p0, "batch": flood(12, False)}, a.warm + a.seconds)
            out[name] = summary(result, window)
            out[name]["verdicts"] = [t.get("preemption") for t in result["ticks"]]
            print(json.dumps(out[name]), file=sys.stderr, flush=True)
    return out


def report(real: dict, abandon: dict) -> tuple[str, list[str]]:
    lines, verdict = [], []
    yardsticks = {"flood": "yardstick", "flood-stream": "yardstick-stream"}
    if real:
        lines += [
            "Real vLLM (CPU build), 4 sequences, P2 jobs of 600 tokens (yardstick: 3 "
            "non-streaming jobs, flood: 12; yardstick-stream: 3 streaming jobs, "
            "flood-stream: 12); each flood's p50 ÷ the yardstick of its kind:",
            "",
            *table(
                [
                    (n, "engine" if n.startswith("yardstick") else "Tollgate", s)
                    for n, s in real.items()
                ],
                {n: (real.get(yardsticks.get(n, n)) or {}).get("p50") for n in real},
            ),
        ]
        lines += ["", "Each round's P0 TTFT p50 (ms), in the order run:", ""]
        lines += [
            f"- {n}: " + ", ".join(fmt_ms(v) for v in s.get("round_p50s", []))
            for n, s in real.items()
        ]
        for name in ("flood", "flood-stream"):
            s = real.get(name)
            yard_run = real.get(yardsticks[name]) or {}
            yard = yard_run.get("p50")
            if s and yard and s["p50"]:
                ok = s["p50"] <= 1.5 * yard
                per_round = sorted(round_ratios(s, yard_run))
                rounds = (
                    f"; per round {percentile(per_round, 0.5):.2f}× median, "
                    f"{per_round[0]:.2f}–{per_round[-1]:.2f}×"
                    if per_round
                    else ""
                )
                verdict.append(
                    f"- {name}: P0 median TTFT through Tollgate within 1.5× of "
                    f"{yardsticks[name]}'s (every round's requests pooled): "
                    f"{'met' if ok else 'MISSED'} ({s['p50']:,.0f} ms vs {yard:,.0f} ms, "
                    f"{s['p50'] / yard:.2f}×{rounds})"
                )
            if s and s["ratio"]:
                ok = abs(s["ratio"] - 1) <= 0.02
                verdict.append(
                    f"- {name}: engine's generated tokens within 2 % of what its clients "
                    f"received: {'met' if ok else 'MISSED'} ({s['generated']:,.0f} vs "
                    f"{s['received']:,}, {s['ratio']:.4f})"
                )
    if abandon:
        lines += [
            "",
            "Simulator that finishes abandoned requests (`--sim-finish-abandoned`), 4 "
            "sequences, 12 non-streaming P2 jobs of 600 tokens through Tollgate:",
            "",
            *table([(n, "Tollgate", s) for n, s in abandon.items()], {}),
        ]
        on, off = abandon.get("preemption on"), abandon.get("preemption off")
        if on and off and on["p50"] and off["p50"]:
            ratio = on["p50"] / off["p50"]
            verdict.append(
                "- finish-abandoned engine: P0 median with preemption on no worse than off "
                f"(within 10 %, the run-to-run noise of a 1-s P0 rate): "
                f"{'met' if ratio <= 1.10 else 'MISSED'} ({on['p50']:,.0f} vs "
                f"{off['p50']:,.0f} ms, {ratio:.2f}×); the controller's verdicts over the "
                f"run: {on.get('verdicts')}"
            )
    return "\n".join(lines), verdict


def write_section(block: str) -> None:
    """Replace this bench's generated block in bench/RESULTS.md."""
    replace_block(SECTION, BEGIN, END, block)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--write", action="store_true", help="replace the block in RESULTS.md")
    ap.add_argument("--workers", type=int, default=2, help="gunicorn workers of the gateway")
    ap.add_argument("--seconds", type=float, default=160.0, help="P0 traffic per kind of run (1/s)")
    ap.add_argument("--rounds", type=int, default=4, help="turns of each flood and its yardstick")
    ap.add_argument("--warm", type=float, default=5.0, help="flood alone before P0 starts")
    ap.add_argument("--policy", default="priority", help="the engines' scheduling policy")
    ap.add_argument("--runs", default="yardstick,flood,yardstick-stream,flood-stream,abandon")
    ap.add_argument("--from-raw", type=Path, help="report an earlier run's raw results")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    a.runs = a.runs.split(",")
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load_before = load_avg()
    p0 = {"rate": 1.0, "count": int(a.seconds), "max_tokens": 16, "delay": a.warm}
    window = (a.warm, a.warm + a.seconds)
    dump = Path(tempfile.gettempdir()) / "admission-real-raw.json"
    if a.from_raw:
        raw = json.loads(a.from_raw.read_text())
    else:
        raw = {"real": {}, "abandon": {}}
        if {"yardstick", "flood", "yardstick-stream", "flood-stream"} & set(a.runs):
            raw["real"] = real_series(a, p0, window)
            dump.write_text(json.dumps(raw))
        if "abandon" in a.runs:
            raw["abandon"] = abandon_series(a, p0, window)
            dump.write_text(json.dumps(raw))
    text, verdict = report(raw["real"], raw["abandon"])
    # A run reported again (--from-raw) keeps the command, machine and time it ran with.
    cmd = "$ .venv/bin/python bench/admission_real.py " + " ".join(sys.argv[1:])
    machine = (
        f"`nproc` {os.cpu_count()}, `uname -m` {platform.machine()}, Python "
        f"{platform.python_version()}; {started}; `{VLLM_IMAGE}`; the whole appliance (web "
        f"`gunicorn -w {a.workers}` with production settings, worker, beat, usage consumer); "
        f"{a.rounds} rounds; engines `--scheduling-policy {a.policy}`; "
        f"load average before {load_before}, after {load_avg()}"
    )
    if a.from_raw and "meta" in raw:
        cmd, machine = raw["meta"]["cmd"], raw["meta"]["machine"]
    elif not a.from_raw:
        raw["meta"] = {"cmd": cmd, "machine": machine}
        dump.write_text(json.dumps(raw))
    out = f"{cmd.strip()}\n{machine}\n\n{text}\n\nTargets:\n\n" + "\n".join(verdict)
    print("\n" + out)
    print(f"\nraw results: {dump}", file=sys.stderr)
    if a.write:
        write_section(
            f"Latest run: {machine}.\n\n```\n{cmd.strip()}\n```\n\n{text}\n\nTargets:\n\n"
            + "\n".join(verdict)
            + "\n"
        )


if __name__ == "__main__":
    main()
