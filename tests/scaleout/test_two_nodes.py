"""Two nodes, each with its own Celery worker subprocess on its own queue, engines on the
real local Docker Engine (the simulator image standing in for vLLM, and its Ray stand-in
for Ray). The control plane's periodic pass (``deployments.reconcile_all``, normally run by
beat) is driven from the test, so the timing is the product's own."""

import threading
import time
from collections.abc import Callable
from decimal import Decimal

import docker
import httpx
import pytest
from django.utils import timezone

from deployments import fleet, runtime, services, tasks
from deployments.choices import NodeStatus, OperationKind, OperationStatus, ReplicaState
from deployments.models import Deployment, EngineProfile, Node, Operation, Replica
from deployments.profiles import ensure_builtin_profiles
from gateway.state import load_snapshot
from metering import services as metering_services
from tenants import services as tenant_services
from tests.deployments.conftest import SIM_IMAGE, sim_env
from tests.gateway.conftest import wait_until_served
from tests.scaleout.conftest import HEARTBEAT_TIMEOUT, stop_worker

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
ARGS = {"max-num-seqs": 4, "max-model-len": 4096}


def drive(check: Callable[[], object], timeout: float = 60.0, every: float = 0.5) -> object:
    """Run the control plane's periodic pass until ``check`` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tasks.reconcile_all()
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(
        f"timed out waiting for {check.__name__ if hasattr(check, '__name__') else check}"
    )


def containers(stack: str, **labels: str) -> list:
    pairs = [f"{runtime.LABEL_STACK}={stack}", *(f"{k}={v}" for k, v in labels.items())]
    # Containers come and go while the control plane works: one removed between Docker's
    # list and its inspect is simply not there any more.
    return docker.from_env().containers.list(
        all=True, filters={"label": pairs}, ignore_removed=True
    )


def seen(*nodes: Node) -> Callable[[], bool]:
    def check() -> bool:
        return all(Node.objects.get(pk=n.pk).last_seen_at for n in nodes)

    return check


def ready(name: str, count: int) -> Callable[[], bool]:
    def check() -> bool:
        rows = Replica.objects.filter(deployment__name=name, state=ReplicaState.READY, healthy=True)
        return rows.count() == count

    return check


def served_tokens(replica: Replica) -> float:
    return (fleet.scrape_replica(replica) or {}).get("generation_tokens_total", 0.0)


def test_placement_spread_failover_and_return(
    nodes: tuple[Node, Node],
    node_workers: Callable,
    small_model: object,
    stack: str,
    gateway_url: str,
) -> None:
    node_a, node_b = nodes
    worker_a = node_workers(node_a)
    node_workers(node_b)
    drive(seen(node_a, node_b))

    # Unpinned, two replicas of ~3.1 GB: the first on node-b (7 GB), the second on node-a
    # (4 GB free against 3.9 GB left on node-b).
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
    assert {op.node.name for op in Operation.objects.filter(kind=OperationKind.DEPLOY)} == {
        "node-a",
        "node-b",
    }
    drive(ready("tiny", 2), timeout=90)
    assert {c.labels[runtime.LABEL_NODE] for c in containers(stack)} == {"node-a", "node-b"}

    # Both serve through one gateway: requests at once go to the least busy replica.
    routes = load_snapshot().routes[small_model.pk]
    assert sorted(u.base_url for u in routes) == sorted(r.base_url for r in Replica.objects.all())
    key = _tenant_key(small_model, gateway_url)
    _concurrent_requests(gateway_url, key)
    assert all(served_tokens(r) > 0 for r in Replica.objects.all())

    # node-a's worker dies: within the heartbeat timeout it is unreachable and its replica
    # has left routing; the replica is placed on node-b, which now has room for it.
    stop_worker(worker_a, kill=True)
    node_b_url = Replica.objects.get(node=node_b).base_url

    def only_node_b_routed() -> bool:
        routes = load_snapshot().routes.get(small_model.pk, [])
        return Node.objects.get(pk=node_a.pk).status == NodeStatus.UNREACHABLE and [
            u.base_url for u in routes
        ] == [node_b_url]

    drive(only_node_b_routed, timeout=HEARTBEAT_TIMEOUT + 30)
    _concurrent_requests(gateway_url, key)  # the gateway only uses node-b now
    drive(
        lambda: (
            ready("tiny", 2)()
            and set(Replica.objects.values_list("node__name", flat=True)) == {"node-b"}
        ),
        timeout=90,
    )
    # The dead node's engine container is still there (nobody drives Docker on node-a).
    assert len(containers(stack, **{runtime.LABEL_NODE: "node-a"})) == 1

    # node-a comes back: online again, its reconcile removes the replica that now runs on
    # node-b, and nothing is duplicated.
    node_workers(node_a)
    drive(
        lambda: (
            Node.objects.get(pk=node_a.pk).status == NodeStatus.ONLINE
            and not containers(stack, **{runtime.LABEL_NODE: "node-a"})
        ),
        timeout=60,
    )
    assert len(containers(stack)) == 2
    assert ready("tiny", 2)()
    keys = {
        (c.labels[runtime.LABEL_DEPLOYMENT], c.labels[runtime.LABEL_REPLICA])
        for c in containers(stack)
    }
    assert len(keys) == 2
    assert len(load_snapshot().routes[small_model.pk]) == 2

    services.set_desired_state(None, Deployment.objects.get(name="tiny"), "stopped")
    drive(lambda: not containers(stack), timeout=60)


def _tenant_key(model: object, gateway_url: str) -> str:
    tenant = tenant_services.create_tenant(None, name="Acme", slug="acme")
    metering_services.set_price(None, model, Decimal("1.00"), Decimal("0.50"), Decimal("2.00"))
    key = tenant_services.issue_api_key(None, tenant, name="scale-out").plaintext
    wait_until_served(gateway_url, key, "tiny-chat", timeout=15)
    return key


def _concurrent_requests(gateway_url: str, key: str) -> None:
    """Four requests at once through the gateway; all answered."""
    answers: list[int] = []

    def call() -> None:
        reply = httpx.post(
            f"{gateway_url}/v1/chat/completions",
            timeout=30,
            headers={"Authorization": f"Bearer {key}"},
            json={
                "model": "tiny-chat",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8,
            },
        )
        answers.append(reply.status_code)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [200] * 4


def test_two_box_tensor_parallel_head_and_worker(
    nodes: tuple[Node, Node],
    node_workers: Callable,
    small_model: object,
    stack: str,
) -> None:
    node_a, node_b = nodes
    node_workers(node_a)
    node_workers(node_b)
    drive(seen(node_a, node_b))
    ensure_builtin_profiles()
    services.create_deployment(
        None,
        name="tp",
        model=small_model,
        node=node_a,
        worker_node=node_b,
        profile=EngineProfile.objects.get(name="simulator"),
        env=sim_env(),
        engine_args={**ARGS, "tensor-parallel-size": 2},
    )
    drive(ready("tp", 1), timeout=90)
    replica = Replica.objects.get()
    assert (replica.node, replica.worker_node) == (node_a, node_b)

    (head,) = containers(stack, **{runtime.LABEL_ROLE: "head"})
    (worker,) = containers(stack, **{runtime.LABEL_ROLE: "worker"})
    assert (
        head.labels[runtime.LABEL_NODE] == "node-a"
        and worker.labels[runtime.LABEL_NODE] == "node-b"
    )
    for container in (head, worker):
        assert container.labels[runtime.LABEL_DEPLOYMENT] == str(replica.deployment_id)
        assert container.labels[runtime.LABEL_REPLICA] == "0"
    head_env, worker_env = _env(head), _env(worker)
    assert head_env["VLLM_HOST_IP"] == "10.99.0.1" and worker_env["VLLM_HOST_IP"] == "10.99.0.2"
    for env in (head_env, worker_env):
        assert env["NCCL_SOCKET_IFNAME"] == env["UCX_NET_DEVICES"] == "enp1s0f1np1"
        assert env["RAY_memory_usage_threshold"] == "1.0"
    assert head.attrs["Config"]["Entrypoint"][:6] == [
        "python3",
        "-m",
        "engine_sim.ray",
        "start",
        "--head",
        "--port=6379",
    ]
    cmd = head.attrs["Config"]["Cmd"]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "ray"
    assert f"--address={head.name}:6379" in worker.attrs["Config"]["Entrypoint"]
    assert "worker node joined" in head.logs().decode()
    reply = httpx.post(
        f"{replica.base_url}/v1/chat/completions",
        timeout=10,
        json={
            "model": "tiny-chat",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
        },
    )
    assert reply.status_code == 200

    # Stop: the head drains and goes first, then the worker on its own node.
    since = int(time.time()) - 1
    services.set_desired_state(None, Deployment.objects.get(name="tp"), "stopped")
    drive(lambda: not containers(stack), timeout=60)
    events = docker.from_env().events(
        since=since,
        until=int(time.time()) + 1,
        decode=True,
        filters={"event": "destroy", "label": f"{runtime.LABEL_STACK}={stack}"},
    )
    assert [e["Actor"]["Attributes"]["name"] for e in events] == [head.name, worker.name]
    stop_op = Operation.objects.get(kind=OperationKind.WORKER_STOP)
    assert stop_op.node == node_b and stop_op.status == OperationStatus.SUCCEEDED


def test_ray_head_that_no_worker_joins_fails_with_the_reason_and_log_tail(
    nodes: tuple[Node, Node],
    node_workers: Callable,
    small_model: object,
    stack: str,
    fast: dict,
) -> None:
    """node-b's worker is down, so no Ray worker ever joins: the head gives up after the
    join timeout and the deploy operation says so, with the head's log tail."""
    node_a, node_b = nodes
    fast["TOLLGATE_RAY_JOIN_TIMEOUT"] = "3"
    Node.objects.update(last_seen_at=timezone.now())
    node_workers(node_a)
    ensure_builtin_profiles()
    services.create_deployment(
        None,
        name="tp",
        model=small_model,
        node=node_a,
        worker_node=node_b,
        profile=EngineProfile.objects.get(name="simulator"),
        env=sim_env(),
        engine_args={**ARGS, "tensor-parallel-size": 2},
    )
    op = Operation.objects.get(kind=OperationKind.DEPLOY)
    drive(lambda: Operation.objects.get(pk=op.pk).status == OperationStatus.FAILED, timeout=60)
    error = Operation.objects.get(pk=op.pk).error
    assert "exited with code 3" in error
    assert (
        "timed out after 3 s waiting for 1 Ray worker node(s) to join the head at 10.99.0.1:6379"
        in error
    )
    assert Replica.objects.get().state == ReplicaState.CRASHED


def _env(container: object) -> dict[str, str]:
    return dict(item.split("=", 1) for item in container.attrs["Config"]["Env"])
