"""What a test session can leave behind, seen from outside: Docker objects, child processes
and database sessions. tests/conftest.py compares them at the start and the end of every
pytest session and fails the stage on anything left over.

Leftovers get a grace period (``TOLLGATE_LEAK_GRACE_SECONDS``, default 15 s) to go away on
their own: a process that was just signalled, or a PostgreSQL backend whose client has just
closed, takes a moment to disappear.

Docker objects count only when they are this run's own: other processes on the machine
(another test run, an admin's containers, another Tollgate) create and remove objects
meanwhile, and those are not this run's leftovers. Every object the tests create carries the
run's token, ``RUN``, in its name or in a label value (``unique_name`` makes such names).
"""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

# One token per test run, in the environment so subprocesses (Celery workers, pytest-xdist's
# workers) see the same one. Lower-case letters and digits, so it fits Compose project names
# and container, network and volume names; "tr" keeps it from ever matching inside a hex
# digest or an id in a label value.
RUN = os.environ.setdefault("TOLLGATE_TEST_RUN", "tr" + uuid.uuid4().hex[:8])
if not re.fullmatch(r"[a-z0-9]{6,24}", RUN):
    raise RuntimeError(f"TOLLGATE_TEST_RUN={RUN!r}: use 6 to 24 lower-case letters and digits")


def unique_name(prefix: str) -> str:
    """A name of this run's own, for a Docker object or anything named after one:
    ``unique_name("tgtest")`` is ``tgtest-<run>-<8 hex digits>``."""
    return f"{prefix}-{RUN}-{uuid.uuid4().hex[:8]}"


def grace_seconds() -> float:
    return float(os.environ.get("TOLLGATE_LEAK_GRACE_SECONDS", "15"))


def settle(find: Callable[[], list[str]], timeout: float) -> list[str]:
    """Poll `find` until it reports nothing or `timeout` passes; what is still there."""
    deadline = time.monotonic() + timeout
    while True:
        left = find()
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


# --- processes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    state: str
    cmdline: str


def _read_proc(pid: int) -> Proc | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None  # gone between listing and reading
    # The command name sits in parentheses and may itself contain spaces or parentheses.
    rest = stat[stat.rindex(")") + 2 :].split()
    return Proc(pid, int(rest[1]), rest[0], cmdline)


def live_descendants(root: int | None = None) -> list[Proc]:
    """Every running (not zombie) process below `root` (default: this one)."""
    root = os.getpid() if root is None else root
    procs = [p for pid in os.listdir("/proc") if pid.isdigit() and (p := _read_proc(int(pid)))]
    children: dict[int, list[Proc]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p)
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child.pid)
    return [p for p in out if p.state != "Z"]


def leftover_processes(before: set[int]) -> list[str]:
    return [
        f"process {p.pid} (parent {p.ppid}): {p.cmdline[:200]}"
        for p in live_descendants()
        if p.pid not in before
    ]


def end_processes(before: set[int]) -> None:
    """Stop what this session started and left running (SIGTERM, then SIGKILL), by PID."""
    left = {p.pid for p in live_descendants() if p.pid not in before}
    _signal(left, signal.SIGTERM)
    still = settle(lambda: [str(p.pid) for p in live_descendants() if p.pid in left], 5)
    _signal({int(pid) for pid in still}, signal.SIGKILL)


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


# --- Docker ------------------------------------------------------------------------------


def docker_client() -> object | None:
    """A Docker client, or None where no engine answers (nothing can have leaked there)."""
    try:
        import docker

        client = docker.from_env(timeout=30)
        client.ping()
        return client
    except Exception:
        return None


def docker_objects(client: object, run: str = RUN) -> set[str]:
    """This run's containers (running or not), networks and volumes, as 'kind name (id)':
    those whose name or one of whose label values contains the run's token."""
    api = client.api
    out = set()
    for c in api.containers(all=True):
        names = ",".join(n.lstrip("/") for n in c.get("Names") or [])
        if _is_of(run, names, c.get("Labels")):
            out.add(f"container {names} ({c['Id'][:12]})")
    for n in api.networks():
        if _is_of(run, n["Name"], n.get("Labels")):
            out.add(f"network {n['Name']} ({n['Id'][:12]})")
    for v in api.volumes().get("Volumes") or []:
        if _is_of(run, v["Name"], v.get("Labels")):
            out.add(f"volume {v['Name']}")
    return out


def _is_of(run: str, name: str, labels: dict[str, str] | None) -> bool:
    return run in name or any(run in value for value in (labels or {}).values())


# --- PostgreSQL --------------------------------------------------------------------------


def other_db_sessions(connection: object) -> list[str]:
    """Sessions on this connection's database other than its own."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT pid, application_name, client_addr, client_port, state, left(query, 120) "
            "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        rows = cur.fetchall()
    return [
        f"database session pid {pid} from {addr}:{port} app={app!r} state={state} last query: {q!r}"
        for pid, app, addr, port, state, q in rows
    ]


def end_db_sessions(connection: object) -> None:
    """Disconnect the other sessions, so the test database can still be dropped."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
