"""How new connections split over the web workers (issue 18).

Starts the web service as the appliance runs it (``gunicorn -c python:config.gunicorn
config.asgi:application -w 2``, uvicorn workers) on a throw-away database
(``tollgate_spreadbench``), then opens bursts of new TCP connections at once from one
client and reads, from ``/proc``, which worker process accepted each one (the worker
holding the server side of the connection). Each burst's connections are closed before
the next. Two columns: the balanced accept loop of config/web.py (``TOLLGATE_WEB_BALANCE=
true``, the default) and uvicorn's own accept on the shared socket (``false``).

    .venv/bin/python bench/worker_spread_bench.py            # 12 bursts of 16
    .venv/bin/python bench/worker_spread_bench.py --write    # and replace the section
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gateway_bench import PG, PY, ROOT, Server, free_port, load_avg, psql, sh, wait_listening

DB_NAME = "tollgate_spreadbench"
SECTION = "## Connections over web workers"
BEGIN, END = (
    "<!-- worker_spread_bench.py --write: begin -->",
    "<!-- worker_spread_bench.py --write: end -->",
)


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def server_sides(port: int) -> dict[int, int]:
    """client port -> inode of the server side, for established connections to ``port``."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                local, remote, state, inode = fields[1], fields[2], fields[3], int(fields[9])
                if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                    out[int(remote.rsplit(":", 1)[1], 16)] = inode
    return out


async def burst(port: int, size: int, workers: list[int], timeout: float = 10.0) -> list[int]:
    """Open ``size`` connections at once; how many each worker accepted."""
    conns = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", port) for _ in range(size)))
    mine = [w.get_extra_info("sockname")[1] for _, w in conns]
    deadline = time.monotonic() + timeout
    try:
        while True:
            sides = server_sides(port)
            held = [socket_inodes(pid) for pid in workers]
            counts = [sum(1 for p in mine if sides.get(p) in inodes) for inodes in held]
            if sum(counts) == size:
                return counts
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {sum(counts)} of {size} connections accepted")
            await asyncio.sleep(0.01)
    finally:
        for _, w in conns:
            w.close()
        await asyncio.gather(*(w.wait_closed() for _, w in conns), return_exceptions=True)


def run_column(spread: bool, bursts: int, size: int, workers: int) -> list[list[int]]:
    tmp = Path(tempfile.mkdtemp(prefix="spreadbench-"))
    env = {
        **os.environ,
        "TOLLGATE_ENV": "test",
        "DATABASE_URL": f"{PG}/{DB_NAME}",
        "TOLLGATE_LOG_LEVEL": "WARNING",
        "TOLLGATE_WEB_BALANCE": "true" if spread else "false",
        "PROMETHEUS_MULTIPROC_DIR": str(tmp / "prom"),  # emptied by config/gunicorn.py
    }
    port = free_port()
    cmd = [PY, "-m", "gunicorn", "-c", "python:config.gunicorn", "config.asgi:application"]
    cmd += ["-w", str(workers), "-b", f"127.0.0.1:{port}", "--graceful-timeout", "5"]
    log = tmp / "gunicorn.log"
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w")
    )
    server = Server(proc)
    try:
        wait_listening(port, proc)
        deadline = time.monotonic() + 60
        # Every worker has run its start-up (uvicorn logs it) before the first burst.
        while log.read_text().count("Application startup complete") < workers:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise TimeoutError(f"the workers did not start (log: {log})")
            time.sleep(0.2)
        server.refresh()

        async def go() -> list[list[int]]:
            out = []
            for _ in range(bursts):
                out.append(await burst(port, size, server.workers))
                await asyncio.sleep(0.2)
            return out

        return asyncio.run(go())
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--bursts", type=int, default=12)
    ap.add_argument("--size", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    before = load_avg()
    psql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
    psql(f"CREATE DATABASE {DB_NAME}")
    try:
        env = {**os.environ, "TOLLGATE_ENV": "test", "DATABASE_URL": f"{PG}/{DB_NAME}"}
        sh([PY, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=env)
        columns = {
            "balanced accept (default)": run_column(True, a.bursts, a.size, a.workers),
            "uvicorn's accept": run_column(False, a.bursts, a.size, a.workers),
        }
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            psql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
    after = load_avg()
    lines = ["| accept | splits of each burst | worst split |", "|---|---|---:|"]
    verdict = []
    for name, splits in columns.items():
        worst = max(splits, key=lambda s: max(s) - min(s))
        lines.append(
            f"| {name} | {' '.join('/'.join(map(str, s)) for s in splits)} | "
            f"{'/'.join(map(str, sorted(worst, reverse=True)))} |"
        )
    default = next(iter(columns.values()))
    worst_default = max(max(s) for s in default)
    limit = a.size * 10 // 16
    verdict.append(
        f"- {a.bursts} bursts of {a.size} new connections over {a.workers} workers, no split "
        f"worse than {limit}/{a.size - limit}: {'met' if worst_default <= limit else 'MISSED'} "
        f"(largest share {worst_default} of {a.size})"
    )
    cmd = "$ .venv/bin/python bench/worker_spread_bench.py " + " ".join(sys.argv[1:])
    machine = (
        f"`nproc` {os.cpu_count()}, `uname -m` {platform.machine()}, kernel "
        f"{platform.release()}, Python {platform.python_version()}; {started}; load average "
        f"before {before}, after {after}"
    )
    text = "\n".join(lines)
    print(f"\n{cmd}\n{machine}\n\n{text}\n\n" + "\n".join(verdict))
    if a.write:
        path = ROOT / "bench" / "RESULTS.md"
        page = path.read_text()
        block = (
            f"Latest run: {machine}.\n\n```\n{cmd.strip()}\n```\n\n{text}\n\nTarget:\n\n"
            + "\n".join(verdict)
            + "\n"
        )
        generated = f"{BEGIN}\n{block}{END}"
        if BEGIN in page and END in page:
            page = page[: page.index(BEGIN)] + generated + page[page.index(END) + len(END) :]
        else:
            page = page.rstrip("\n") + f"\n\n{SECTION}\n\n{generated}\n"
        path.write_text(page)


if __name__ == "__main__":
    main()
