"""Fixtures for scale-out tests: two nodes on the local Docker Engine, each with its own
Celery worker subprocess consuming its own queue (ended by PID), fast heartbeat timings,
and clean-up by label (containers, the test's engine network, its queues in Redis)."""

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from decimal import Decimal

import docker
import pytest
from django.conf import settings as django_settings

from core.redis import get_redis
from deployments import services
from deployments.models import CatalogModel, Node
from tests.databases import database_url
from tests.deployments.conftest import stack  # noqa: F401 - the per-test stack fixture
from tests.gateway.conftest import REDIS_PREFIX, gateway_url  # noqa: F401 - one real gateway

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GB = 10**9
# Long enough that a live node's worker, starved by a loaded machine, keeps its heartbeat
# (3 s was missed by the living node under --under-load), short enough for quick failovers.
HEARTBEAT_TIMEOUT = 8.0


@pytest.fixture(autouse=True)
def redis_namespace(settings: object) -> str:
    """The gateway subprocess's Redis prefix, so its routing table hears every change."""
    settings.TOLLGATE_REDIS_PREFIX = REDIS_PREFIX
    return REDIS_PREFIX


@pytest.fixture(autouse=True)
def no_node_users_left(redis_namespace: str) -> Iterator[None]:
    """Joined nodes' Redis ACL users of this test are deleted after it (Redis is shared)."""
    yield
    client = get_redis()
    for user in client.execute_command("ACL", "USERS"):
        name = user.decode() if isinstance(user, bytes) else user
        if name.startswith(f"{redis_namespace}-node-"):
            client.execute_command("ACL", "DELUSER", name)


@pytest.fixture
def fast(settings: object, stack: str) -> Iterator[dict[str, str]]:  # noqa: F811
    """Short timeouts for this test and the same values for the node workers' environment."""
    values = {
        "TOLLGATE_NODE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT),
        "TOLLGATE_RAY_JOIN_TIMEOUT": "20",
        "TOLLGATE_ENGINE_NETWORK": f"{stack}-net",
        "TOLLGATE_ORPHAN_GRACE_SECONDS": "0",
        "TOLLGATE_DRAIN_TIMEOUT": "5",
        "TOLLGATE_STOP_GRACE_SECONDS": "2",
        "TOLLGATE_ENGINE_READY_TIMEOUT": "60",
        "TOLLGATE_ENGINE_POLL_SECONDS": "0.1",
        "TOLLGATE_RESTART_BACKOFF_SECONDS": "0.5",
    }
    for name, value in values.items():
        setattr(settings, name, value if name == "TOLLGATE_ENGINE_NETWORK" else float(value))
    yield values
    client = docker.from_env()
    for network in client.networks.list(names=[f"{stack}-net"]):
        network.remove()


def make_node(name: str, stack: str, limit: int, address: str) -> Node:  # noqa: F811
    """A node on this machine's Docker Engine; engines publish on loopback only. The
    memory limit makes the two nodes differ (on one machine their heartbeats agree)."""
    return services.register_node(
        None,
        name=name,
        docker_url=django_settings.TOLLGATE_DOCKER_URL,
        engine_host="127.0.0.1",
        queue=f"node.{stack}.{name}",
        unified_memory=True,
        memory_limit_bytes=limit,
        high_speed_interface="enp1s0f1np1",
        high_speed_address=address,
    )


@pytest.fixture
def nodes(transactional_db: None, stack: str, fast: dict) -> Iterator[tuple[Node, Node]]:  # noqa: F811
    node_a = make_node("node-a", stack, 4 * GB, "10.99.0.1")
    node_b = make_node("node-b", stack, 7 * GB, "10.99.0.2")
    yield node_a, node_b
    get_redis().delete(node_a.queue, node_b.queue)


@pytest.fixture
def node_workers(
    transactional_db: None,
    stack: str,
    fast: dict,  # noqa: F811
    redis_namespace: str,
) -> Iterator[Callable[[Node], subprocess.Popen]]:
    """Start a node's Celery worker (its queue only); every one started is ended by PID."""
    started: list[subprocess.Popen] = []
    env = lambda: {  # noqa: E731 - read at each start: a test may change ``fast`` first
        **os.environ,
        **fast,
        "DATABASE_URL": database_url(),
        "TOLLGATE_ENV": "test",
        "TOLLGATE_REDIS_PREFIX": redis_namespace,
        "TOLLGATE_STACK_ID": stack,
        "TOLLGATE_MODEL_CACHE_VOLUME": f"{stack}-models",
        "TOLLGATE_COMPILE_CACHE_VOLUME": f"{stack}-compile",
        "TOLLGATE_PULL_POLICY": "never",
        "TOLLGATE_LOG_LEVEL": "WARNING",
    }

    def start(node: Node) -> subprocess.Popen:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "config",
                "worker",
                "-Q",
                node.queue,
                "-n",
                f"{node.name}-{stack}@%h",
                "--pool",
                "threads",
                "--concurrency",
                "3",
                "--without-heartbeat",
                "--without-gossip",
                "--without-mingle",
                "--loglevel",
                "WARNING",
            ],
            cwd=ROOT,
            env=env(),
            stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(ROOT, f".pytest-scaleout-{node.name}.log"), "a"),
        )
        started.append(worker)
        return worker

    yield start
    for worker in started:
        stop_worker(worker)


def stop_worker(worker: subprocess.Popen, kill: bool = False) -> None:
    if worker.poll() is not None:
        return
    worker.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
    try:
        worker.wait(timeout=15)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


@pytest.fixture
def small_model(transactional_db: None) -> CatalogModel:
    """1 B parameters at 16 bit: 2 GB of weights + 1 GiB overhead ≈ 3.1 GB per replica."""
    return services.create_model(
        None,
        served_name="tiny-chat",
        source="Qwen/Qwen3-0.6B",
        params_billions=Decimal("1"),
        context_length=4096,
        kv_bytes_per_token=1024,
    )
