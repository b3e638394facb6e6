"""A real gateway (gunicorn + uvicorn workers) in front of real simulator engines.

The gateway runs as a subprocess against the test database, so the data tests create must
be committed (``transactional_db``); the gateway learns about it through the same Redis
pub/sub invalidation production uses.
"""

import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from core.changes import publish_change
from deployments import services as deployment_services
from deployments.choices import ReplicaState, Task, Visibility
from deployments.models import CatalogModel, Deployment, Node, Replica
from metering import services as metering_services
from tenants import services as tenant_services
from tenants.models import Tenant
from tests.databases import database_url

ROOT = Path(__file__).resolve().parents[2]
REDIS_PREFIX = f"gwtest-{secrets.token_hex(6)}"
METRICS_TOKEN = secrets.token_urlsafe(16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {port}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Engine:
    port: int
    names: tuple[str, ...]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_engine(names: tuple[str, ...], *args: str) -> tuple[Engine, subprocess.Popen]:
    port = free_port()
    cmd = [
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
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_listening(port, proc)
    return Engine(port, names), proc


@pytest.fixture(scope="session")
def engines() -> Iterator[dict[str, Engine]]:
    """Fast chat engine (also serving a private alias), a slow one, an embedding one."""
    started = {
        "chat": start_engine(
            ("sim-chat", "acme-private"),
            "--sim-ttft-ms",
            "2",
            "--sim-decode-tps",
            "2000",
            "--max-num-seqs",
            "256",
        ),
        "slow": start_engine(
            ("sim-slow",),
            "--sim-ttft-ms",
            "5",
            "--sim-decode-tps",
            "20",
            "--sim-output-tokens-min",
            "400",
            "--sim-output-tokens-max",
            "400",
            # Streams pause after 10 tokens (until SIGUSR1, which no test sends): a client
            # hanging up there has exactly 10, however slow the machine.
            "--sim-pause-after-tokens",
            "10",
        ),
        "embed": start_engine(("sim-embed",), "--runner", "pooling"),
    }
    yield {name: engine for name, (engine, _) in started.items()}
    for _, proc in started.values():
        stop(proc)


def start_gateway(
    workers: int, extra_env: dict[str, str] | None = None, log: Path | None = None
) -> tuple[subprocess.Popen, str]:
    """A gunicorn server of config.asgi on the test database and the tests' Redis prefix."""
    port = free_port()
    env = {
        **os.environ,
        "TOLLGATE_ENV": "test",
        "DATABASE_URL": database_url(),
        "TOLLGATE_REDIS_PREFIX": REDIS_PREFIX,
        "TOLLGATE_METRICS_TOKEN": METRICS_TOKEN,
        "TOLLGATE_LOG_LEVEL": "WARNING",
        **(extra_env or {}),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "-c",
            "python:config.gunicorn",
            "config.asgi:application",
            "-w",
            str(workers),
            "-b",
            f"127.0.0.1:{port}",
            "--graceful-timeout",
            "5",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(log, "w") if log else subprocess.DEVNULL,
    )
    wait_listening(port, proc)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def gateway_url(django_db_setup: None, django_db_blocker: object) -> Iterator[str]:
    """A gunicorn server with two uvicorn workers serving config.asgi, on the test database."""
    # Short queue timeouts, so the admission tests see them without long waits.
    timeouts = {"TOLLGATE_QUEUE_TIMEOUT_P0": "20", "TOLLGATE_QUEUE_TIMEOUT_P1": "4"}
    timeouts["TOLLGATE_QUEUE_TIMEOUT_P2"] = "4"
    proc, url = start_gateway(2, timeouts, log=ROOT / ".pytest-gateway.log")
    yield url
    stop(proc)


@pytest.fixture(autouse=True)
def redis_namespace(settings: object) -> str:
    """Share the gateway's Redis prefix, so invalidations reach it."""
    settings.TOLLGATE_REDIS_PREFIX = REDIS_PREFIX
    return REDIS_PREFIX


@dataclass
class World:
    """Two tenants with keys, models served by simulator engines, prices."""

    url: str
    tenant_a: Tenant
    tenant_b: Tenant
    key_a: str
    key_b: str
    chat: CatalogModel
    private_a: CatalogModel
    deployment: Deployment

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"


def make_model(
    name: str, task: str = Task.GENERATE, visibility: str = Visibility.PUBLIC
) -> CatalogModel:
    return deployment_services.create_model(
        None,
        served_name=name,
        source=f"sim/{name}",
        task=task,
        params_billions=Decimal("1"),
        context_length=4096,
        visibility=visibility,
    )


def deploy(
    model: CatalogModel,
    node: Node,
    *ports: int,
    max_num_seqs: int = 256,
    engine_args: dict[str, object] | None = None,
) -> Deployment:
    # Rows as the deployments app leaves them once its replicas are ready; the engines
    # themselves are the simulator processes started above (no Docker needed here).
    deployment = Deployment.objects.create(
        name=f"{model.served_name}-dep",
        model=model,
        node=node,
        image="tollgate/engine-sim:latest",
        engine_args={"max-num-seqs": max_num_seqs, **(engine_args or {})},
        desired_state="running",
        state="ready",
    )
    for index, port in enumerate(ports):
        Replica.objects.create(
            deployment=deployment,
            index=index,
            node=node,
            host="127.0.0.1",
            port=port,
            state=ReplicaState.READY,
            healthy=True,
        )
    publish_change("deployment", deployment.pk)
    return deployment


def wait_until_refused(url: str, key: str, timeout: float = 30.0) -> None:
    """Poll until every gateway worker answers the key with 401 (a revocation has arrived)."""
    deadline, streak = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        try:
            r = httpx.get(
                f"{url}/v1/models",
                headers={"Authorization": f"Bearer {key}"},
                timeout=max(1.0, deadline - time.monotonic()),
            )
            refused = r.status_code == 401
        except httpx.TransportError:
            refused = False
        streak = streak + 1 if refused else 0
        if streak >= 6:  # several refusals in a row: both workers have reloaded
            return
        time.sleep(0.05)
    raise TimeoutError(f"the gateway still accepts the key after {timeout}s")


def wait_until_served(url: str, key: str, model: str, timeout: float = 30.0) -> None:
    """Poll until every gateway worker knows the key and the model (pub/sub reload)."""
    deadline, streak = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        try:
            # A gateway still starting, or slow on a loaded machine, is "not yet", not a failure.
            r = httpx.get(
                f"{url}/v1/models",
                headers={"Authorization": f"Bearer {key}"},
                timeout=max(1.0, deadline - time.monotonic()),
            )
            ok = r.status_code == 200 and model in [m["id"] for m in r.json()["data"]]
        except httpx.TransportError:
            ok = False
        streak = streak + 1 if ok else 0
        if streak >= 6:  # several hits in a row: both workers have reloaded
            return
        time.sleep(0.05)
    raise TimeoutError(f"gateway did not learn about {model} in {timeout}s")


@pytest.fixture
def world(transactional_db: None, gateway_url: str, engines: dict[str, Engine]) -> World:
    node = deployment_services.register_node(
        None, name="sim-node", docker_url="unix:///x", engine_host="127.0.0.1"
    )
    tenant_a = tenant_services.create_tenant(None, name="Acme", slug="acme")
    tenant_b = tenant_services.create_tenant(None, name="Bravo", slug="bravo")
    chat = make_model("sim-chat")
    private_a = make_model("acme-private", visibility=Visibility.PRIVATE)
    deployment_services.grant_model(None, private_a, tenant_a)
    embed = make_model("sim-embed", task=Task.EMBED)
    slow = make_model("sim-slow")
    deployment = deploy(chat, node, engines["chat"].port)
    deploy(private_a, node, engines["chat"].port)
    deploy(embed, node, engines["embed"].port)
    deploy(slow, node, engines["slow"].port)
    for model in (chat, private_a, embed, slow):
        metering_services.set_price(None, model, Decimal("1.00"), Decimal("0.50"), Decimal("2.00"))
    key_a = tenant_services.issue_api_key(None, tenant_a, name="a").plaintext
    key_b = tenant_services.issue_api_key(None, tenant_b, name="b").plaintext
    wait_until_served(gateway_url, key_a, "sim-slow")
    wait_until_served(gateway_url, key_b, "sim-slow")
    return World(gateway_url, tenant_a, tenant_b, key_a, key_b, chat, private_a, deployment)


def add_routed_model(
    world: World,
    name: str,
    port: int,
    max_num_seqs: int = 256,
    engine_args: dict[str, object] | None = None,
) -> CatalogModel:
    """A public model served by the engine on ``port``, known to the gateway on return."""
    model = make_model(name)
    node = Node.objects.get(name="sim-node")
    deploy(model, node, port, max_num_seqs=max_num_seqs, engine_args=engine_args)
    wait_until_served(world.url, world.key_a, name)
    return model
