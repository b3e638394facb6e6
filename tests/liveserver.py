"""The appliance's web process (gunicorn + uvicorn workers on config.asgi) on loopback, for
tests that need the real server: its logs, its static files, a browser.

It runs on the test database (so tests that use it need ``transactional_db``: their data
must be committed to be seen) and writes its log to a file the test can read.
"""

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from django.db import connection

from tests.gateway.conftest import free_port, stop, wait_listening

ROOT = Path(__file__).resolve().parents[1]


def database_url() -> str:
    db = connection.settings_dict
    password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
    host, port = db["HOST"] or "127.0.0.1", db["PORT"] or 5432
    return f"postgres://{db['USER'] or 'postgres'}{password}@{host}:{port}/{db['NAME']}"


@dataclass
class Server:
    url: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def collectstatic(env: dict[str, str]) -> None:
    subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--noinput", "-v", "0"],
        cwd=ROOT,
        env=env,
        check=True,
    )


def wait_healthy(url: str, server: subprocess.Popen, timeout: float = 90.0) -> None:
    """Until a worker answers /healthz: the port listens before the workers have booted."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the web process exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url}/healthz did not answer 200 in {timeout} s")


@contextmanager
def serve(log: Path, port: int | None = None, **settings: str) -> Iterator[Server]:
    """The web process with the test database and ``settings`` as its environment."""
    env = {
        **os.environ,
        "TOLLGATE_ENV": "test",
        "DJANGO_DEBUG": "false",  # as deployed: the console's own error pages, ServeStatic
        "DATABASE_URL": database_url(),
        "TOLLGATE_LOG_LEVEL": "WARNING",
        **settings,
    }
    collectstatic(env)
    port = port or free_port()
    with open(log, "w") as stderr:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gunicorn",
                "-c",
                "python:config.gunicorn",
                "config.asgi:application",
                "-w",
                "1",
                "-b",
                f"127.0.0.1:{port}",
                "--graceful-timeout",
                "5",
                "--timeout",
                "120",  # a worker booting on a busy machine is not a hung worker
            ],
            cwd=ROOT,
            env=env,
            stdout=stderr,
            stderr=stderr,
        )
    try:
        wait_listening(port, server)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, server)
        yield Server(url=url, log=log)
    finally:
        stop(server)
