"""A node joined the way a second box joins: its agent (``python -m nodeagent``) runs with
an environment holding no control-plane secret, spends its join token at the control
plane's live API, and serves its Docker to the control plane's worker over its own Redis
user. node-a is the control plane's own box (a worker of its own); node-b is joined. The
engines run on the real local Docker Engine (the simulator standing in for vLLM)."""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from django.conf import settings as django_settings
from redis.exceptions import AuthenticationError

from core.redis import get_redis
from deployments import fleet, joining, relay, runtime, services
from deployments.choices import NodeStatus, OperationKind, OperationStatus
from deployments.models import Deployment, Node, Operation, Replica
from gateway.state import load_snapshot
from tests.databases import database_url
from tests.deployments.conftest import SIM_IMAGE, sim_env
from tests.scaleout.conftest import GB, ROOT, make_node
from tests.scaleout.test_two_nodes import (
    ARGS,
    _concurrent_requests,
    _tenant_key,
    containers,
    drive,
    ready,
    seen,
    served_tokens,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
# What a node must never hold: the control plane's database and Django secrets.
FORBIDDEN_NAMES = (
    "DATABASE_URL",
    "DJANGO_SECRET_KEY",
    "TOLLGATE_DB_PASSWORD",
    "TOLLGATE_KEY_PEPPER",
)


def redis_url() -> str:
    kwargs = get_redis().connection_pool.connection_kwargs
    return f"redis://{kwargs.get('host', '127.0.0.1')}:{kwargs.get('port', 6379)}/0"


def secrets_of_the_control_plane() -> list[str]:
    db = django_settings.DATABASES["default"]
    values = [django_settings.SECRET_KEY, django_settings.TOLLGATE_KEY_PEPPER, database_url()]
    return [v for v in [*values, db.get("PASSWORD") or ""] if v]


@pytest.fixture
def agent_for(
    live_server: object, tmp_path: Path, settings: object, stack: str
) -> Iterator[Callable[[str], subprocess.Popen]]:
    """Start a node agent for a join token, with only what a node's compose file gives it."""
    started: list[subprocess.Popen] = []

    def start(token: str) -> subprocess.Popen:
        env = {
            "PATH": os.environ["PATH"],
            "TOLLGATE_NODE_NAME": "node-b",
            "TOLLGATE_JOIN_TOKEN": token,
            "TOLLGATE_CONTROL_PLANE_URL": live_server.url,
            "TOLLGATE_CONTROL_PLANE_REDIS": redis_url(),
            "TOLLGATE_DOCKER_URL": settings.TOLLGATE_DOCKER_URL,  # this box's Docker API policy
            "TOLLGATE_NODE_ENGINE_HOST": "127.0.0.1",
            "TOLLGATE_NODE_UNIFIED_MEMORY": "true",
            "TOLLGATE_NODE_CREDENTIAL_FILE": str(tmp_path / "state" / "credential.json"),
            "TOLLGATE_AGENT_FACTS_SECONDS": "0.5",
            "TOLLGATE_AGENT_REVOKED_AFTER_SECONDS": "1",
        }
        agent = subprocess.Popen(
            [sys.executable, "-m", "nodeagent"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "agent.log", "a"),
        )
        started.append(agent)
        return agent

    yield start
    for agent in started:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=15)


def wait_for(check: Callable[[], object], timeout: float, every: float = 0.1) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s")


def test_a_joined_node_holds_no_secret_deploys_serves_reports_and_is_cut_off_by_revoking(
    node_workers: Callable,
    agent_for: Callable,
    small_model: object,
    stack: str,
    settings: object,
    tmp_path: Path,
    gateway_url: str,
    client_for: Callable,
    root: object,
) -> None:
    settings.TOLLGATE_JOINED_NODE_QUEUE = f"nodes.{stack}"
    node_a = make_node("node-a", stack, 4 * GB, "10.99.0.1")
    node_workers(node_a)

    # node-b joins with its one-time token and nothing else of the control plane's.
    token = joining.create_join_token(None, "node-b").token
    agent = agent_for(token)
    node_b = wait_for(lambda: Node.objects.filter(name="node-b").first(), timeout=30)
    environ = Path(f"/proc/{agent.pid}/environ").read_bytes().split(b"\0")
    names = {item.split(b"=", 1)[0].decode() for item in environ if item}
    assert names.isdisjoint(FORBIDDEN_NAMES), names
    credential_file = tmp_path / "state" / "credential.json"
    credential = json.loads(
        wait_for(lambda: credential_file.exists() and credential_file.read_text(), timeout=10)
    )
    assert credential_file.stat().st_mode & 0o777 == 0o600
    given = b"\0".join(environ) + credential_file.read_bytes()
    for secret in secrets_of_the_control_plane():
        assert secret.encode() not in given
    assert node_b.docker_url == relay.node_url("node-b") and node_b.queue == f"nodes.{stack}"
    # The admin sets its memory budget as for any node; the control plane's worker (on the
    # joined-node queue) drives its Docker through the agent.
    services.update_node(None, node_b, memory_limit_bytes=7 * GB)
    node_workers(node_b)
    drive(seen(node_a, node_b))
    node_b.refresh_from_db()
    assert node_b.status == NodeStatus.ONLINE and node_b.docker_version
    assert node_b.available_memory_bytes > 0  # the agent's own report of its box

    # It deploys and serves: the first replica on node-b (7 GB), the second on node-a.
    services.create_deployment(
        None,
        name="tiny",
        model=small_model,
        image=SIM_IMAGE,
        replicas=2,
        env=sim_env(SIM_DECODE_TPS="40", SIM_OUTPUT_TOKENS_MIN="12"),
        engine_args=ARGS,
    )
    assert [r.node.name for r in Replica.objects.order_by("index")] == ["node-b", "node-a"]
    drive(ready("tiny", 2), timeout=90)
    assert {c.labels[runtime.LABEL_NODE] for c in containers(stack)} == {"node-a", "node-b"}
    deploy_b = Operation.objects.get(kind=OperationKind.DEPLOY, node=node_b)
    assert deploy_b.status == OperationStatus.SUCCEEDED and deploy_b.finished_at
    key = _tenant_key(small_model, gateway_url)
    _concurrent_requests(gateway_url, key)
    replica_b = Replica.objects.get(node=node_b)
    assert served_tokens(replica_b) > 0
    # Its engine's log tail reaches the console through the same channel.
    assert drive(lambda: fleet.read_log_tail(replica_b.pk))

    # Revoked from the admin API: within seconds the agent is cut off and exits, node-b
    # shows revoked, and its replica has left routing while node-a keeps serving.
    revoked_at = time.monotonic()
    reply = client_for(root).post("/api/v1/nodes/node-b/revoke/")
    assert reply.status_code == 200 and reply.json()["status"] == NodeStatus.REVOKED
    assert wait_for(lambda: agent.poll() is not None, timeout=10) and agent.returncode == 0
    assert time.monotonic() - revoked_at < 5
    assert "revoked" in (tmp_path / "agent.log").read_text()
    with pytest.raises(AuthenticationError):
        redis.Redis.from_url(
            redis_url(), username=credential["redis_user"], password=credential["redis_password"]
        ).ping()
    assert Node.objects.get(pk=node_b.pk).status == NodeStatus.REVOKED
    routes = load_snapshot().routes[small_model.pk]
    assert [u.base_url for u in routes] == [Replica.objects.get(node=node_a).base_url]
    _concurrent_requests(gateway_url, key)  # answered by node-a alone
    drive(lambda: Node.objects.get(pk=node_b.pk).status == NodeStatus.REVOKED, timeout=3)
    assert not Replica.objects.get(pk=replica_b.pk).healthy

    services.set_desired_state(None, Deployment.objects.get(name="tiny"), "stopped")
    try:
        drive(lambda: not containers(stack, **{runtime.LABEL_NODE: "node-a"}), timeout=60)
    except AssertionError:
        ops = Operation.objects.values_list("kind", "node__name", "status", "error", "progress")
        raise AssertionError(f"node-a's engine still there; operations: {list(ops)}") from None
