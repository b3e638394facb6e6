"""Where one Tollgate worker's CPU goes: cProfile inside a gunicorn worker under bench load.

As a module, ``bench.gateway_profile:application`` is config.asgi's application with two
extra paths, ``/__profile/start`` and ``/__profile/stop`` (the latter writes the stats to
``$BENCH_PROFILE_OUT``); the gateway code is untouched. As a script it starts the same
stack as bench/gateway_bench.py with ONE worker (so both calls reach the same process),
profiles each scenario and prints the functions with the most own time, per request or
per streamed chunk.

    .venv/bin/python bench/gateway_profile.py                 # json c=64 and stream c=64
    .venv/bin/python bench/gateway_profile.py --top 40 --sort cumulative
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import cProfile
import io
import json
import os
import pstats
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

_profiler = cProfile.Profile()


async def _plain(send: Any, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/plain")],
        }
    )
    await send({"type": "http.response.body", "body": body})


# --- phase timing (wall clock, no profiler): monkeypatched from here, gateway code untouched ---

_current: contextvars.ContextVar[dict | None] = contextvars.ContextVar("bench_phases", default=None)
_records: list[dict] = []
_lag: list[float] = []
_timing = False


def _patch_phases() -> None:
    from gateway import limiter, relay

    def timed(owner: Any, name: str, before: str, after: str) -> None:
        original = getattr(owner, name)

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            rec = _current.get()
            if rec is not None:
                rec[before] = time.perf_counter()
            try:
                return await original(*args, **kwargs)
            finally:
                if rec is not None:
                    rec[after] = time.perf_counter()

        setattr(owner, name, wrapper)

    timed(limiter.Limiter, "admit", "admit0", "admit1")
    timed(limiter.Limiter, "settle", "settle0", "settle1")
    timed(relay, "_post", "post0", "post1")  # to the engine's response headers


async def _loop_lag() -> None:
    """How late a 1 ms sleep wakes up: the event loop's queueing delay."""
    while _timing:
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        _lag.append(time.perf_counter() - t - 0.001)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * (len(values) - 1)))] * 1000, 3)


def _phase_report() -> dict:
    phases = {
        "request in -> admit start (read body, auth, parse, route)": ("t0", "admit0"),
        "admit (Lua call incl. pool wait)": ("admit0", "admit1"),
        "admit end -> upstream POST start": ("admit1", "post0"),
        "upstream POST -> engine response headers": ("post0", "post1"),
        "engine headers -> first body byte to client": ("post1", "first"),
        "request in -> first body byte to client": ("t0", "first"),
        "request in -> last byte to client": ("t0", "last"),
        "settle (Lua call incl. pool wait)": ("settle0", "settle1"),
    }
    out = {"requests": len(_records)}
    for label, (a, b) in phases.items():
        values = [r[b] - r[a] for r in _records if a in r and b in r]
        out[label] = {"p50_ms": _pct(values, 0.5), "p99_ms": _pct(values, 0.99), "n": len(values)}
    out["event-loop lag of a 1 ms sleep"] = {
        "p50_ms": _pct(_lag, 0.5),
        "p99_ms": _pct(_lag, 0.99),
        "n": len(_lag),
    }
    return out


def _wrap(inner: Any) -> Any:
    _patch_phases()

    async def application(scope: dict, receive: Any, send: Any) -> None:
        global _timing, _profiler
        path = scope.get("path", "")
        if scope["type"] == "http" and path == "/__profile/start":
            _profiler.enable()
            return await _plain(send, b"on")
        if scope["type"] == "http" and path == "/__profile/stop":
            _profiler.disable()
            _profiler.dump_stats(os.environ["BENCH_PROFILE_OUT"])
            _profiler = cProfile.Profile()  # a fresh profile for the next scenario
            return await _plain(send, b"off")
        if scope["type"] == "http" and path == "/__phases/start":
            _records.clear()
            _lag.clear()
            _timing = True
            asyncio.get_running_loop().create_task(_loop_lag())
            return await _plain(send, b"on")
        if scope["type"] == "http" and path == "/__phases/stop":
            _timing = False
            return await _plain(send, json.dumps(_phase_report()).encode())
        if not _timing or scope["type"] != "http":
            return await inner(scope, receive, send)
        rec = {"t0": time.perf_counter()}
        _current.set(rec)

        async def timed_send(message: dict) -> None:
            await send(message)
            if message["type"] == "http.response.body":
                now = time.perf_counter()
                if message.get("body") and "first" not in rec:
                    rec["first"] = now
                if not message.get("more_body"):
                    rec["last"] = now

        await inner(scope, receive, timed_send)
        _records.append(rec)

    return application


if __name__ != "__main__":
    from config.asgi import application as _inner

    application = _wrap(_inner)


def _get(url: str) -> None:
    with urllib.request.urlopen(url, timeout=30) as r:
        r.read()


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gateway_bench import DB_NAME, SIMS, Column, bench_stack, run_scenario, start_tollgate

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--sort", default="tottime", choices=["tottime", "cumulative"])
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument(
        "--callers", default="", help="also print who calls functions matching this regex"
    )
    ap.add_argument(
        "--cases",
        default="json:64,stream:64",
        help="kind:concurrency pairs to profile (kind json or stream, or api-kind for the "
        "agent APIs: responses-json:1, messages-stream:64)",
    )
    ap.add_argument(
        "--db-name", default=DB_NAME, help="the throw-away database (dropped before and after)"
    )
    ap.add_argument(
        "--phases",
        action="store_true",
        help="wall-clock time per request phase instead of cProfile (no profiler overhead)",
    )
    ap.add_argument(
        "--workers", type=int, default=1, help="with --phases: gunicorn workers (1 reports all)"
    )
    a = ap.parse_args()
    cases = []
    for case in a.cases.split(","):
        name, conc = case.split(":")
        api, _, kind = name.rpartition("-")
        cases.append(
            (
                f"{name} c={conc}",
                {
                    "api": api or "chat",
                    "model": "bench-stream" if kind == "stream" else "bench-model",
                    "stream": kind == "stream",
                    "concurrency": int(conc),
                    "duration": a.duration,
                    "requests": 100_000,
                },
            )
        )
    if a.phases and a.cases == ap.get_default("cases"):
        cases = [
            (
                f"{kind} c={c}",
                {
                    "model": "bench-stream" if kind == "stream" else "bench-model",
                    "stream": kind == "stream",
                    "concurrency": c,
                    "duration": a.duration,
                    "requests": 100_000,
                },
            )
            for kind in ("json", "stream")
            for c in (1, 16, 64)
        ]
    with bench_stack(a.db_name) as st:
        out = st.tmp / "profile.prof"
        env = {**st.env, "BENCH_PROFILE_OUT": str(out)}
        workers = a.workers if a.phases else 1
        url, srv = start_tollgate(
            workers, env, st.key, st.tmp / "tollgate.log", app="bench.gateway_profile:application"
        )
        st.servers.append(srv)
        col = Column("Tollgate w1 (profiled)", dict.fromkeys(SIMS, url), st.key, srv)
        run_scenario(st.load, col, {**cases[0][1], "duration": 2})  # warm-up
        srv.refresh()
        for name, spec in cases:
            if a.phases:
                _get(url + "/__phases/start")
                r = run_scenario(st.load, col, spec)
                with urllib.request.urlopen(url + "/__phases/stop", timeout=30) as resp:
                    report = json.load(resp)
                print(
                    f"\n=== {name}: {r['requests']} requests, {r['errors']} errors, "
                    f"{r['rps']:.0f} req/s, "
                    f"client p50 {r['lat_p50']:.2f} ms, TTFT p50 {r['ttft_p50'] or 0:.2f} ms "
                    f"(phases of the {report.pop('requests')} requests one worker served)"
                )
                for label, v in report.items():
                    print(f"  {label:<60} p50 {v['p50_ms']} ms  p99 {v['p99_ms']} ms  (n={v['n']})")
                continue
            _get(url + "/__profile/start")
            r = run_scenario(st.load, col, spec)
            _get(url + "/__profile/stop")
            unit, count = ("chunk", r["frames"]) if spec["stream"] else ("request", r["requests"])
            print(
                f"\n=== {name}: {r['requests']} requests, {r['frames']} chunks, {r['errors']} "
                "errors, "
                f"{r['rps']:.0f} req/s, worker CPU {r['server_cpu_s']:.2f} s "
                f"= {r['server_cpu_s'] / max(count, 1) * 1e6:.1f} µs per {unit} (profiler on)"
            )
            buf = io.StringIO()
            stats = pstats.Stats(str(out), stream=buf)
            total = stats.total_tt
            stats.sort_stats(a.sort).print_stats(a.top)
            if a.callers:
                stats.print_callers(a.callers)
            print(f"profiled time {total:.2f} s = {total / max(count, 1) * 1e6:.1f} µs per {unit}")
            print(buf.getvalue().split("\n", 6)[-1] if buf.getvalue() else "")


if __name__ == "__main__":
    main()
