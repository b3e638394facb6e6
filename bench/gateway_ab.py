"""A change to the gateway measured against what came before it, interleaved.

bench/gateway_bench.py runs one column after another; on a two-core machine whose speed
drifts by tens of per cent over minutes, two columns minutes apart differ by more than a
refactoring can. Here both gateways (gunicorn with 2 workers each, this tree's and the
``--before`` checkout's, same venv, database and simulators) run at once, idle while the
other is measured, and every scenario of gateway_bench.py is run on them in turn, A B B A
A B …, ``--rounds`` times each (short runs). Per scenario the medians over the rounds are
compared: latency p50 (TTFT p50 for streams), tokens/s, and the server's CPU per request;
and, since the machine drifts between rounds, each round's after ÷ before (the two were
measured back to back) with the median and quartiles of those paired ratios: the verdict
reads the paired medians, the quartiles say how far one round's ratio strays.

    git worktree add /tmp/before <commit>
    .venv/bin/python bench/gateway_ab.py --before /tmp/before            # print the table
    .venv/bin/python bench/gateway_ab.py --before /tmp/before --write    # and RESULTS.md
    .venv/bin/python bench/gateway_ab.py --from-raw /tmp/gateway-ab-raw.json  # report again

Verdict (issue 28): no scenario more than 5 % slower after than before (the median of the
paired ratios of p50 latency, or TTFT for streams, and of CPU per request; tokens/s no more
than 5 % lower).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
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


def paired(per_column: dict[str, list[dict]], key: str, stream: bool) -> list[float]:
    """Each round's after ÷ before of one figure (rounds where both have it)."""
    field = {"latency": "ttft_p50" if stream else "lat_p50", "tok_s": "tok_s"}.get(key)
    ratios = []
    for b, a in zip(per_column["before"], per_column["after"], strict=True):
        if key == "cpu_ms":
            if not (b.get("server_cpu_s") and a.get("server_cpu_s") and b["requests"]):
                continue
            x = b["server_cpu_s"] / b["requests"]
            y = a["server_cpu_s"] / a["requests"] if a["requests"] else None
        else:
            x, y = b.get(field), a.get(field)
        if x and y:
            ratios.append(y / x)
    return ratios


def quartiles(values: list[float]) -> tuple[float, float, float] | None:
    if len(values) < 2:
        return (values[0],) * 3 if values else None
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, statistics.median(values), q3


def summary(per_column: dict[str, list[dict]]) -> str:
    return " ".join(
        f"{name}={figures(rs, False)['latency']:.2f}" for name, rs in per_column.items()
    )


def report(res: dict[str, dict[str, list[dict]]], rounds: int) -> tuple[list[str], list[str]]:
    lines = [
        "| scenario | p50 ms before | after | ÷ | paired ÷ (quartiles) | tok/s before | after "
        "| paired ÷ | CPU ms/request before | after | paired ÷ (quartiles) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    slower = []
    for scenario, per_column in res.items():
        stream = "stream" in scenario
        b = figures(per_column["before"], stream)
        a = figures(per_column["after"], stream)
        cells = []
        for key, digits in (("latency", 2), ("tok_s", 0), ("cpu_ms", 3)):
            x, y = b[key], a[key]
            cells += [f"{x:,.{digits}f}", f"{y:,.{digits}f}"]
            if key == "latency":
                cells.append(f"{y / x:.2f}" if x and y else "—")
            q = quartiles(paired(per_column, key, stream))
            if q is None:
                cells.append("—")
                continue
            cells.append(f"{q[1]:.2f}" if key == "tok_s" else f"{q[1]:.2f} ({q[0]:.2f}–{q[2]:.2f})")
            worse = q[1] > SLOWER if key != "tok_s" else q[1] < 1 / SLOWER
            if worse:
                slower.append(f"{scenario} {key} {q[1]:.3f}×")
        label = f"{scenario} (TTFT)" if stream else scenario
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    verdict = [
        f"- no scenario more than 5 % slower after than before (median of {rounds} paired "
        f"rounds' ratios): {'met' if not slower else 'MISSED: ' + ', '.join(slower)}"
    ]
    return lines, verdict


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--before", type=Path, help="the earlier checkout")
    ap.add_argument("--from-raw", type=Path, help="report an earlier run's raw results")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scale", type=float, default=0.5, help="multiply each run's duration")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--only", default="", help="comma-separated scenario names (e.g. 'responses json c=1')"
    )
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--db-name", default="tollgate_bench_ab")
    a = ap.parse_args()
    if a.from_raw:
        raw = json.loads(a.from_raw.read_text())
        lines, verdict = report(raw["results"], raw["rounds"])
        publish(raw["head"], raw["command"], lines, verdict, a.write)
        return
    if a.before is None:
        ap.error("--before is required (or --from-raw)")
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
    about = (
        f"Latest run: `nproc` {os.cpu_count()}, `uname -m` {platform.machine()}, Python "
        f"{platform.python_version()}; {started}; before = {head}, after = {here}; "
        f"gunicorn -w {a.workers} each; {a.rounds} interleaved rounds × scale {a.scale}; "
        f"load average before {load0}, after {load_avg()}."
    )
    command = (
        f"$ .venv/bin/python bench/gateway_ab.py --before <checkout of {head}> "
        f"--rounds {a.rounds} --scale {a.scale}"
        + (f" --only '{a.only}'" if a.only else "")
        + " --write"
    )
    dump = Path(tempfile.gettempdir()) / "gateway-ab-raw.json"
    raw = {"head": about, "command": command, "rounds": a.rounds, "results": res}
    dump.write_text(json.dumps(raw))
    print(f"raw results: {dump}", file=sys.stderr)
    publish(about, command, lines, verdict, a.write)


def publish(about: str, command: str, lines: list[str], verdict: list[str], write: bool) -> None:
    """Print the report; with ``write``, also as this bench's block in bench/RESULTS.md."""
    block = "\n".join([about, "", "```", command, "```", "", *lines, "", *verdict, ""])
    print(block)
    if write:
        replace_block(SECTION, BEGIN, END, block)


if __name__ == "__main__":
    main()
