"""The whole appliance for bench/gateway_bench.py's ``Tollgate wN appliance`` column.

What ``docker compose up`` runs beside the web service, on the same cores, with the
commands of compose/entrypoint.sh and production settings (``TOLLGATE_ENV=production``,
DEBUG off, log level as shipped): ``web`` (gunicorn with N uvicorn workers and its access
log on), ``worker`` (Celery, queues ``control,node.local`` unless a bench gives its own,
concurrency 4), ``beat`` and ``usage`` (``manage.py consume_usage``). Each part writes its
log to a file in the run's directory, as Docker would collect its stdout. The bench's
engines are rows on a node called ``bench-node``, whose queue no worker here consumes, so
reconcile leaves them alone (bench/on_demand_bench.py gives the worker its real node's
queue, and the demand queue, so it starts and stops engines as an appliance's does);
everything else beat schedules (engine scraping, the admission controller, orphan reaping,
usage ingestion, quota reconciliation) runs as in production. Celery's broker is a Redis
database of its own (the first empty one of ``BROKER_DBS``), so no other Celery on this
Redis takes these tasks; its keys are removed when the appliance stops.

CPU is counted over every process of every part; ``cpu_by_part`` splits it.
"""

from __future__ import annotations

import secrets
import subprocess
import time
from pathlib import Path

import redis
from gateway_bench import PY, ROOT, Server, cpu_seconds, free_port, wait_listening, wait_serving

BROKER_DBS = range(9, 16)
STREAM_GROUP = "metering"  # metering/ingest.py


class Appliance:
    """Several processes measured as one server (the interface of gateway_bench.Server)."""

    def __init__(self, parts: dict[str, Server], stream: str, broker: redis.Redis) -> None:
        self.parts, self.stream, self.broker = parts, stream, broker
        self.redis = redis.Redis.from_url("redis://127.0.0.1:6379/0")

    @property
    def pids(self) -> list[int]:
        return [pid for part in self.parts.values() for pid in part.pids]

    @property
    def workers(self) -> list[int]:
        return self.parts["web"].workers

    def refresh(self) -> None:
        for part in self.parts.values():
            part.refresh()

    def stop(self) -> None:
        for part in reversed(list(self.parts.values())):
            part.stop()
        clear(self.broker)

    def cpu_by_part(self) -> dict[str, float]:
        return {name: cpu_seconds(part.pids) for name, part in self.parts.items()}

    def backlog(self) -> int | None:
        """Usage events not yet ingested: the group's lag plus its pending entries."""
        try:
            groups = self.redis.xinfo_groups(self.stream)
        except redis.ResponseError:
            return None  # no stream yet
        for g in groups:
            if g["name"] in (STREAM_GROUP, STREAM_GROUP.encode()):
                return int(g.get("lag") or 0) + int(g["pending"])
        return None

    def drain_seconds(self, timeout: float = 30.0) -> float | None:
        """Seconds from now until the usage consumer has caught up (None: not in time)."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.backlog() == 0:
                return time.monotonic() - started
            time.sleep(0.05)
        return None


def clear(broker: redis.Redis) -> None:
    """Remove the broker database's keys (it was empty when the appliance started)."""
    keys = list(broker.scan_iter(count=1000))
    for i in range(0, len(keys), 500):
        broker.delete(*keys[i : i + 500])


def empty_broker_db() -> int:
    for db in BROKER_DBS:
        if redis.Redis.from_url(f"redis://127.0.0.1:6379/{db}").dbsize() == 0:
            return db
    raise RuntimeError(f"no empty Redis database among {list(BROKER_DBS)} for Celery's broker")


def key_pepper(env: dict) -> str:
    """The API-key pepper the bench stack's settings derive (the appliance gets a secret key
    of its own, and its own derived pepper would refuse the bench's key)."""
    code = (
        "import django; django.setup(); from django.conf import settings; "
        "print(settings.TOLLGATE_KEY_PEPPER)"
    )
    env = {**env, "DJANGO_SETTINGS_MODULE": "config.settings"}
    out = subprocess.run([PY, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    out.check_returncode()
    return out.stdout.strip().splitlines()[-1]


def start_appliance(
    workers: int,
    env: dict,
    key: str,
    tmp: Path,
    models: frozenset[str] | None = None,
    queues: str = "control,node.local",
) -> tuple[str, Appliance]:
    """The appliance's processes, serving once ``key`` lists ``models`` (default:
    bench/gateway_bench.py's); the worker consumes ``queues`` (comma-separated)."""
    db = empty_broker_db()
    broker = redis.Redis.from_url(f"redis://127.0.0.1:6379/{db}")
    env = {
        **env,
        "TOLLGATE_ENV": "production",
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(48),
        # The bench key was issued under the bench stack's settings: hash with its pepper.
        "TOLLGATE_KEY_PEPPER": key_pepper(env),
        "DJANGO_DEBUG": "false",
        "REDIS_URL": "redis://127.0.0.1:6379/0",
        "CELERY_BROKER_URL": f"redis://127.0.0.1:6379/{db}",
        "TOLLGATE_UPSTREAM_CLIENT": "tollgate",
    }
    env.pop("TOLLGATE_LOG_LEVEL", None)  # as shipped
    port = free_port()
    commands = {
        "web": [
            PY,
            "-m",
            "gunicorn",
            "-c",
            "python:config.gunicorn",
            "config.asgi:application",
            "--workers",
            str(workers),
            "--bind",
            f"127.0.0.1:{port}",
            "--graceful-timeout",
            "5",
            "--timeout",
            "0",
            "--keep-alive",
            "75",
            "--forwarded-allow-ips",
            "127.0.0.1",
            "--access-logfile",
            "-",
            "--error-logfile",
            "-",
        ],  # fmt: skip
        "worker": [
            PY,
            "-m",
            "celery",
            "-A",
            "config",
            "worker",
            "--queues",
            queues,
            "--concurrency",
            "4",
            "--hostname",
            f"worker-{secrets.token_hex(3)}@bench",
            "--without-gossip",
            "--without-mingle",
            "--loglevel",
            "INFO",
        ],  # fmt: skip
        "beat": [
            PY,
            "-m",
            "celery",
            "-A",
            "config",
            "beat",
            "--schedule",
            str(tmp / "celerybeat-schedule"),
            "--loglevel",
            "INFO",
        ],  # fmt: skip
        "usage": [PY, "manage.py", "consume_usage"],
    }
    parts: dict[str, Server] = {}
    stream = f"{env['TOLLGATE_REDIS_PREFIX']}:usage:events"
    try:
        for name, cmd in commands.items():
            log = open(tmp / f"appliance-{name}.log", "a")  # noqa: SIM115 - the process's
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            parts[name] = Server(proc)
        wait_listening(port, parts["web"].proc)
        url = f"http://127.0.0.1:{port}"
        wait_serving(url, key, parts["web"].proc, **({"models": models} if models else {}))
        appliance = Appliance(parts, stream, broker)
        deadline = time.monotonic() + 60
        while appliance.backlog() is None:  # the consumer created its group
            for name, part in parts.items():
                if part.proc.poll() is not None:
                    raise RuntimeError(f"appliance {name} exited (log in {tmp})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the usage consumer did not start (log in {tmp})")
            time.sleep(0.2)
        appliance.refresh()
        return url, appliance
    except BaseException:
        for part in parts.values():
            part.stop()
        clear(broker)
        raise
