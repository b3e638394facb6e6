"""A change to the gateway measured against what came before it, interleaved.

bench/gateway_bench.py runs one column after another; on a two-core machine whose speed
drifts by tens of per cent over minutes, two columns minutes apart differ by more than a
refactoring can. Here both gateways (gunicorn with 2 workers each, this tree's and the
``--before`` checkout's, same venv, database and simulators) run at once, idle while the
other is measured, and every scenario of gateway_bench.py is run on them in turn, A B B A
A B …, ``--rounds`` times each (short runs). Per scenario the medians over the rounds are
compared: latency p50 (TTFT p50 for streams), tokens/s, and the server's CPU per request.

    git worktree add /tmp/before <commit>
    .venv/bin/python bench/gateway_ab.py --before /tmp/before            # print the table
    .venv/bin/python bench/gateway_ab.py --before /tmp/before --write    # and RESULTS.md

Verdict (issue 28): no scenario more than 5 % slower after than before (median p50 latency,
or TTFT for streams; median CPU per request).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from pathlib import Path

from gateway_bench import (
    Column,
    bench_stack,
    load_avg,
    replace_block,
    run_scenario,
    scenarios,
    start_tollgate,
)

SECTION = "## Gateway overhead: the gateway split, before and after"
BEGIN, END = "<!-- gateway_ab.py --write: begin -->", "<!-- gateway_ab.py --write: end -->"
SLOWER = 1.05


def measure(
    load: object, columns: dict[str, Column], rounds: int, scale: float, only: list[str]
) -> dict[str, dict[str, list[dict]]]:
    """scenario -> column -> one result per round, the columns' order alternating."""
    out: dict[str, dict[str, list[dict]]] = {}
    names = list(columns)
    for scenario, spec in scenarios(scale):
        if only and scenario not in only:
            continue
        spec = {k: v for k, v in spec.items() if k != "rounds"}
        out[scenario] = {name: [] for name in names}
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                col = columns[name]
                if col.server:
                    col.server.refresh()
                result = run_scenario(load, col, spec)
                out[scenario][name].append(result)
        print(f"  {scenario}: {summary(out[scenario])}", file=sys.stderr, flush=True)
    return out


def figures(results: list[dict], stream: bool) -> dict[str, float | None]:
    def median(key: str) -> float | None:
        values = [r[key] for r in results if r.get(key) is not None]
        return statistics.median(values) if values else None

    cpu = [
        r["server_cpu_s"] / r["requests"] * 1000
        for r in results
        if r.get("server_cpu_s") is not None and r["requests"]
    ]
    return {
        "latency": median("ttft_p50" if stream else "lat_p50"),
        "tok_s": median("tok_s"),
        "cpu_ms": statistics.median(cpu) if cpu else None,
        "errors": sum(r["errors"] for r in results),
    }


def summary(per_column: dict[str, list[dict]]) -> str:
    return " ".join(
        f"{name}={figures(rs, False)['latency']:.2f}" for name, rs in per_column.items()
    )


def report(res: dict[str, dict[str, list[dict]]], rounds: int) -> tuple[list[str], list[str]]:
    lines = [
        "| scenario | p50 ms before | after | ÷ | tok/s before | after | ÷ "
        "| CPU ms/request before | after | ÷ |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    slower = []
    for scenario, per_column in res.items():
        stream = "stream" in scenario
        b = figures(per_column["before"], stream)
        a = figures(per_column["after"], stream)
        cells = []
        for key, digits in (("latency", 2), ("tok_s", 0), ("cpu_ms", 3)):
            x, y = b[key], a[key]
            ratio = y / x if x and y else None
            cells += [f"{x:,.{digits}f}", f"{y:,.{digits}f}", f"{ratio:.2f}" if ratio else "—"]
            worse = ratio is not None and (ratio > SLOWER if key != "tok_s" else ratio < 1 / SLOWER)
            if worse:
                slower.append(f"{scenario} {key} {ratio:.2f}×")
        label = f"{scenario} (TTFT)" if stream else scenario
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    verdict = [
        f"- no scenario more than 5 % slower after than before (medians of {rounds} "
        f"interleaved rounds): {'met' if not slower else 'MISSED: ' + ', '.join(slower)}"
    ]
    return lines, verdict


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--before", type=Path, required=True, help="the earlier checkout")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scale", type=float, default=0.5, help="multiply each run's duration")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--only", default="", help="comma-separated scenario names (e.g. 'responses json c=1')"
    )
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--db-name", default="tollgate_bench_ab")
    a = ap.parse_args()
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load0 = load_avg()
    with bench_stack(a.db_name) as st:
        columns = {}
        for i, (name, tree) in enumerate((("before", a.before), ("after", None))):
            env = {**st.env, "TOLLGATE_REDIS_PREFIX": f"{st.env['TOLLGATE_REDIS_PREFIX']}-{i}"}
            log = st.tmp / f"tollgate-{name}.log"
            kwargs = {"tree": tree} if tree else {}
            url, srv = start_tollgate(a.workers, env, st.key, log, **kwargs)
            st.servers.append(srv)
            columns[name] = Column(name, {m: url for m in st.ports}, st.key, srv)
        only = [name.strip() for name in a.only.split(",") if name.strip()]
        res = measure(st.load, columns, a.rounds, a.scale, only)
    lines, verdict = report(res, a.rounds)
    head = os.popen(f"git -C {a.before} log -1 --format=%h").read().strip()
    here = os.popen("git log -1 --format=%h").read().strip()
    block = "\n".join(
        [
            f"Latest run: `nproc` {os.cpu_count()}, `uname -m` {platform.machine()}, Python "
            f"{platform.python_version()}; {started}; before = {head}, after = {here}; "
            f"gunicorn -w {a.workers} each; {a.rounds} interleaved rounds × scale {a.scale}; "
            f"load average before {load0}, after {load_avg()}.",
            "",
            "```",
            f"$ .venv/bin/python bench/gateway_ab.py --before <checkout of {head}> "
            f"--rounds {a.rounds} --scale {a.scale}"
            + (f" --only '{a.only}'" if a.only else "")
            + " --write",
            "```",
            "",
            *lines,
            "",
            *verdict,
            "",
        ]
    )
    print(block)
    if a.write:
        replace_block(SECTION, BEGIN, END, block)


if __name__ == "__main__":
    main()
