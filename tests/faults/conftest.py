"""Fault-injection and abuse suite: real processes, started and killed by this suite.

Every gateway here is a real gunicorn with two uvicorn workers (``-w 2``) serving
``config.asgi`` against the test database, started *after* the test committed its rows,
so it loads them at start-up. Engines are simulator processes. Processes are stopped by
PID (their own process group) even when a test fails. The shared PostgreSQL and Redis are
never stopped: faults are injected on this suite's own ``redis-server`` or through a TCP
proxy in front of PostgreSQL.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import pytest
from django.conf import settings as django_settings

from core.redis import get_redis
from deployments import services as deployment_services
from deployments.choices import ReplicaState, Task, Visibility
from deployments.models import CatalogModel, Deployment, Node, Replica
from metering import services as metering_services
from tenants import services as tenant_services
from tenants.models import Tenant
from tests.databases import database_url

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen | None = None, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {port}")


def wait_for(condition: Callable[[], object], timeout: float, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the process and everything it started (it leads its own session)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# --- Processes ---------------------------------------------------------------------------


class Procs:
    """Processes one test started; all killed (by process group) at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[subprocess.Popen] = []

    def spawn(
        self, name: str, cmd: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        log = open(self.tmp / f"{name}-{len(self.started)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env or dict(os.environ),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        proc.log_path = Path(log.name)
        self.started.append(proc)
        return proc

    def close(self) -> None:
        for proc in reversed(self.started):
            kill_group(proc, signal.SIGKILL)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.close()


@dataclass
class Engine:
    port: int
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_engine(procs: Procs, names: tuple[str, ...], *args: str) -> Engine:
    port = free_port()
    proc = procs.spawn(
        f"engine-{names[0]}",
        [
            sys.executable,
            "-m",
            "engine_sim",
            names[0],
            "--served-model-name",
            *names,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-model-len",
            "4096",
            *args,
        ],
    )
    wait_listening(port, proc)
    return Engine(port, proc)


@dataclass
class Gateway:
    """One gunicorn (master + 2 uvicorn workers) serving Tollgate on a loopback port."""

    procs: Procs
    env: dict[str, str]
    workers: int = 2
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Gateway:
        self.proc = self.procs.spawn(
            "gateway",
            [
                sys.executable,
                "-m",
                "gunicorn",
                "-c",
                "python:config.gunicorn",
                "config.asgi:application",
                "-w",
                str(self.workers),
                "-b",
                f"127.0.0.1:{self.port}",
                "--graceful-timeout",
                "3",
                "--backlog",
                "4096",
            ],
            self.env,
        )
        wait_listening(self.port, self.proc)
        return self

    def wait_ready(self, key: str, timeout: float = 30.0) -> Gateway:
        """Until both workers answer with the key known (several successes in a row)."""
        import httpx

        streak, deadline = 0, time.monotonic() + timeout
        while streak < 8:
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway not ready:\n{self.log()[-3000:]}")
            try:
                ok = (
                    httpx.get(
                        f"{self.url}/v1/models",
                        headers={"Authorization": f"Bearer {key}"},
                        timeout=5,
                    ).status_code
                    == 200
                )
            except httpx.HTTPError:
                ok = False
            streak = streak + 1 if ok else 0
            time.sleep(0.02 if ok else 0.2)
        return self

    def kill9(self) -> None:
        """SIGKILL to the master and every worker at once: nothing gets to clean up."""
        kill_group(self.proc, signal.SIGKILL)

    def log(self) -> str:
        return self.proc.log_path.read_text(errors="replace") if self.proc else ""


@pytest.fixture
def gateway_env(redis_namespace: str) -> Callable[..., dict[str, str]]:
    """The environment of a gateway on this test's Redis prefix and the test database."""

    def make(**overrides: str) -> dict[str, str]:
        return {
            **os.environ,
            "TOLLGATE_ENV": "test",
            "DATABASE_URL": database_url(),
            "REDIS_URL": django_settings.REDIS_URL,
            "TOLLGATE_REDIS_PREFIX": redis_namespace,
            "TOLLGATE_LOG_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
            **overrides,
        }

    return make


class RedisServer:
    """This suite's own redis-server on a loopback port, stopped and restarted by PID.

    AOF with fsync on every write, like the appliance's (which fsyncs every second), so a
    SIGKILL loses nothing it acknowledged and a restart on the same directory resumes.
    """

    def __init__(self, procs: Procs, directory: Path) -> None:
        self.procs, self.dir, self.port = procs, directory, free_port()
        self.proc: subprocess.Popen | None = None
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = self.procs.spawn(
            "redis",
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--protected-mode",
                "no",
            ],
        )
        wait_listening(self.port, self.proc)
        return self

    def kill9(self) -> None:
        kill_group(self.proc, signal.SIGKILL)


@pytest.fixture
def own_redis(procs: Procs, tmp_path: Path, settings: object) -> Iterator[RedisServer]:
    """A private Redis; this test process talks to it too (settings and the cached client)."""
    server = RedisServer(procs, tmp_path / "redis").start()
    shared = settings.REDIS_URL
    settings.REDIS_URL = server.url
    get_redis.cache_clear()
    yield server
    # Back to the shared Redis before the suite-wide fixtures clean their keys there.
    settings.REDIS_URL = shared
    get_redis.cache_clear()


# --- Data --------------------------------------------------------------------------------


@dataclass
class World:
    """Tenants, keys, models and routes, committed before any gateway starts."""

    node: Node
    tenant_a: Tenant
    tenant_b: Tenant
    key_a: str
    key_b: str
    chat: CatalogModel
    deployments: list[Deployment] = field(default_factory=list)


def make_model(
    name: str,
    task: str = Task.GENERATE,
    visibility: str = Visibility.PUBLIC,
    context_length: int = 4096,
) -> CatalogModel:
    return deployment_services.create_model(
        None,
        served_name=name,
        source=f"sim/{name}",
        task=task,
        params_billions=Decimal("1"),
        context_length=context_length,
        visibility=visibility,
    )


def route(model: CatalogModel, node: Node, port: int, max_num_seqs: int = 256) -> Deployment:
    """Rows as the deployments app leaves them once a replica is ready; the engine itself is
    a simulator process (Docker is not what these tests are about)."""
    deployment = Deployment.objects.create(
        name=f"{model.served_name}-dep",
        model=model,
        node=node,
        image="tollgate/engine-sim:latest",
        engine_args={"max-num-seqs": max_num_seqs},
        desired_state="running",
        state="ready",
    )
    Replica.objects.create(
        deployment=deployment,
        index=0,
        node=node,
        host="127.0.0.1",
        port=port,
        state=ReplicaState.READY,
        healthy=True,
    )
    return deployment


def build_world(
    engine_port: int,
    *,
    key_a_limits: dict | None = None,
    tenant_a: dict | None = None,
    price: tuple[str, str, str] = ("1.00", "0.50", "2.00"),
) -> World:
    node = deployment_services.register_node(
        None, name="sim-node", docker_url="unix:///x", engine_host="127.0.0.1"
    )
    a = tenant_services.create_tenant(None, name="Acme", slug="acme", **(tenant_a or {}))
    b = tenant_services.create_tenant(None, name="Bravo", slug="bravo")
    chat = make_model("sim-chat")
    dep = route(chat, node, engine_port)
    metering_services.set_price(None, chat, *(Decimal(p) for p in price))
    key_a = tenant_services.issue_api_key(None, a, name="a", **(key_a_limits or {})).plaintext
    key_b = tenant_services.issue_api_key(None, b, name="b").plaintext
    return World(node, a, b, key_a, key_b, chat, [dep])


def chat_body(
    model: str = "sim-chat", max_tokens: int = 8, stream: bool = False, **extra: object
) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }
