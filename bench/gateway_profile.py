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
import cProfile
import io
import os
import pstats
import sys
import urllib.request
from pathlib import Path
from typing import Any

_profiler = cProfile.Profile()


async def _plain(send: Any, body: bytes) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body})


def _wrap(inner: Any) -> Any:
    async def application(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/__profile/start":
            _profiler.enable()
            return await _plain(send, b"on")
        if scope["type"] == "http" and scope["path"] == "/__profile/stop":
            _profiler.disable()
            _profiler.dump_stats(os.environ["BENCH_PROFILE_OUT"])
            _profiler.__init__()  # a fresh profile for the next scenario
            return await _plain(send, b"off")
        return await inner(scope, receive, send)

    return application


if __name__ != "__main__":
    from config.asgi import application as _inner

    application = _wrap(_inner)


def _get(url: str) -> None:
    with urllib.request.urlopen(url, timeout=30) as r:
        r.read()


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gateway_bench import SIMS, Column, bench_stack, run_scenario, start_tollgate

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--sort", default="tottime", choices=["tottime", "cumulative"])
    ap.add_argument("--duration", type=float, default=5.0)
    a = ap.parse_args()
    cases = [
        ("json c=64", {"model": "bench-model", "stream": False, "concurrency": 64, "duration": a.duration,
                       "requests": 100_000}),
        ("stream c=64", {"model": "bench-stream", "stream": True, "concurrency": 64, "duration": a.duration,
                         "requests": 100_000}),
    ]
    with bench_stack() as st:
        out = st.tmp / "profile.prof"
        env = {**st.env, "BENCH_PROFILE_OUT": str(out)}
        url, srv = start_tollgate(1, env, st.key, st.tmp / "tollgate.log", app="bench.gateway_profile:application")
        st.servers.append(srv)
        col = Column("Tollgate w1 (profiled)", dict.fromkeys(SIMS, url), st.key, srv)
        run_scenario(st.load, col, {**cases[0][1], "duration": 2})  # warm-up
        srv.refresh()
        for name, spec in cases:
            _get(url + "/__profile/start")
            r = run_scenario(st.load, col, spec)
            _get(url + "/__profile/stop")
            unit, count = ("chunk", r["frames"]) if spec["stream"] else ("request", r["requests"])
            print(f"\n=== {name}: {r['requests']} requests, {r['frames']} chunks, {r['errors']} errors, "
                  f"{r['rps']:.0f} req/s, worker CPU {r['server_cpu_s']:.2f} s "
                  f"= {r['server_cpu_s'] / max(count, 1) * 1e6:.1f} µs per {unit} (profiler on)")
            buf = io.StringIO()
            stats = pstats.Stats(str(out), stream=buf)
            total = stats.total_tt
            stats.sort_stats(a.sort).print_stats(a.top)
            print(f"profiled time {total:.2f} s = {total / max(count, 1) * 1e6:.1f} µs per {unit}")
            print(buf.getvalue().split("\n", 6)[-1] if buf.getvalue() else "")


if __name__ == "__main__":
    main()
