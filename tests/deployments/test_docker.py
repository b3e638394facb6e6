"""Engines on the real local Docker Engine, with the simulator image built locally
(scripts/build-images). No registry is contacted: the pull policy is "never"."""

import threading
import time
from collections.abc import Callable
from decimal import Decimal

import docker
import httpx
import orjson
import pytest
from django.db import connection

from core.keyspace import invalidation_channel
from core.redis import get_redis
from deployments import fleet, operations, reconcile, runtime, services, tasks
from deployments.choices import DeploymentState, OperationKind, OperationStatus, ReplicaState
from deployments.models import Deployment, EngineProfile, Node, Operation, Replica
from deployments.profiles import ensure_builtin_profiles
from gateway.state import load_snapshot
from tests.deployments.conftest import SIM_IMAGE, sim_env

pytestmark = [pytest.mark.docker, pytest.mark.django_db(transaction=True)]


def wait_for(check: Callable[[], object], timeout: float = 30.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {check}")


def containers(stack: str) -> list:
    return docker.from_env().containers.list(
        all=True, filters={"label": f"{runtime.LABEL_STACK}={stack}"}, ignore_removed=True
    )


def deploy(node: Node, model: object, name: str = "tiny", **fields: object) -> Deployment:
    fields.setdefault("env", sim_env())
    fields.setdefault("engine_args", {"max-num-seqs": 4, "max-model-len": 4096})
    services.create_deployment(None, name=name, model=model, node=node, image=SIM_IMAGE, **fields)
    return Deployment.objects.get(name=name)


def test_deploy_serves_then_stop_drains_and_removes(
    docker_node: Node, sim_model: object, stack: str, eager_tasks: None
) -> None:
    pubsub = get_redis().pubsub()
    pubsub.subscribe(invalidation_channel())
    deployment = deploy(
        docker_node, sim_model, env=sim_env(SIM_DECODE_TPS="25", SIM_OUTPUT_TOKENS_MIN="40")
    )

    replica = Replica.objects.get(deployment=deployment)
    assert (replica.state, replica.healthy, replica.host) == ("ready", True, "127.0.0.1")
    assert Deployment.objects.get(pk=deployment.pk).state == DeploymentState.READY

    (container,) = containers(stack)
    attrs = container.attrs
    assert container.labels[runtime.LABEL_MANAGED] == "true"
    assert container.labels[runtime.LABEL_DEPLOYMENT] == str(deployment.pk)
    assert container.labels[runtime.LABEL_REPLICA] == "0"
    assert attrs["Config"]["Cmd"] == [
        "Qwen/Qwen3-0.6B",
        "--served-model-name",
        "tiny-chat",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--max-num-seqs",
        "4",
        "--max-model-len",
        "4096",
    ]
    host_config = attrs["HostConfig"]
    # A private IPC namespace with a large /dev/shm: never the host's (ipc=host).
    assert host_config["IpcMode"] in ("private", "shareable")
    assert host_config["ShmSize"] == 16 * 2**30
    assert {m["Destination"]: m["Name"] for m in attrs["Mounts"]} == {
        "/root/.cache/huggingface": f"{stack}-models",
        "/root/.cache/vllm": f"{stack}-compile",
    }
    assert "no-new-privileges" in host_config["SecurityOpt"]
    assert host_config["LogConfig"]["Config"] == {"max-size": "50m", "max-file": "3"}
    assert host_config["PortBindings"]["8000/tcp"][0]["HostIp"] == "127.0.0.1"
    assert host_config["RestartPolicy"]["Name"] in ("", "no")  # Tollgate supervises
    # This node has no GPU: no device request, no GPU ulimits (CPU-only hosts refuse them).
    assert not host_config.get("DeviceRequests") and not host_config.get("Ulimits")
    assert not host_config.get("NanoCpus")  # no figure, no profile headroom: every core
    assert "SIM_LOAD_SECONDS=0.4" in attrs["Config"]["Env"]

    # Cold-start profile per phase and a real progress bar from the shard lines.
    op = Operation.objects.get(deployment=deployment, kind=OperationKind.DEPLOY)
    assert op.status == OperationStatus.SUCCEEDED and op.progress == 100
    phases = op.detail["replicas"]["0"]["phases"]
    assert {"pull", "create", "start", "load", "models", "warmup", "total"} <= phases.keys()
    # The warm-up's tokens are on the engine's counters and billed to no tenant: recorded,
    # so the counters can be reconciled with the bill (tests/vllm/test_lifecycle.py).
    warmup = op.detail["replicas"]["0"]["warmup_usage"]
    assert warmup["completion_tokens"] == 1 and warmup["prompt_tokens"] > 0

    # The gateway's routing table has it; the replica change was published to gateways.
    routes = load_snapshot().routes[sim_model.pk]
    assert [u.base_url for u in routes] == [replica.base_url]
    reply = httpx.post(
        f"{routes[0].base_url}/v1/chat/completions",
        timeout=10,
        json={
            "model": "tiny-chat",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 2,
        },
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    published = []
    while (message := pubsub.get_message(timeout=0.2)) is not None or not published:
        if message and message["type"] == "message":
            published.append(orjson.loads(message["data"]))
        if message is None:
            break
    assert {"kind": "replica", "id": str(replica.pk)} in published

    # Stop with a request in flight: it finishes, then the container is gone.
    slow = {}

    def long_request() -> None:
        slow["reply"] = httpx.post(
            f"{replica.base_url}/v1/chat/completions",
            timeout=30,
            json={
                "model": "tiny-chat",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 40,
                "stream": False,
            },
        )

    worker = threading.Thread(target=long_request)
    worker.start()
    wait_for(lambda: (fleet.scrape_replica(replica) or {}).get("running"))
    services.set_desired_state(None, deployment, "stopped")
    worker.join()
    assert slow["reply"].status_code == 200
    assert containers(stack) == []
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.STOPPED
    assert Deployment.objects.get(pk=deployment.pk).state == DeploymentState.STOPPED
    assert sim_model.pk not in load_snapshot().routes


def test_killed_engine_is_restarted_by_reconcile_with_backoff(
    docker_node: Node, sim_model: object, stack: str, eager_tasks: None, settings: object
) -> None:
    settings.TOLLGATE_RESTART_BACKOFF_SECONDS = 1.5
    deployment = deploy(docker_node, sim_model)
    (container,) = containers(stack)
    container.kill()

    done = reconcile.reconcile_node(docker_node)
    replica = Replica.objects.get(deployment=deployment)
    assert done["crashed"] == 1 and replica.state == ReplicaState.CRASHED and not replica.healthy
    assert replica.crash_count == 1 and replica.exit_code == 137
    assert sim_model.pk not in load_snapshot().routes
    # Within the backoff nothing restarts it.
    assert reconcile.reconcile_node(docker_node)["restarts"] == 0

    wait_for(
        lambda: (
            Replica.objects.get(pk=replica.pk).next_restart_at
            <= __import__("django.utils.timezone").utils.timezone.now()
        ),
        5,
    )
    assert reconcile.reconcile_node(docker_node)["restarts"] == 1
    replica.refresh_from_db()
    assert replica.state == ReplicaState.READY and replica.healthy
    (new_container,) = containers(stack)
    assert new_container.id != container.id and new_container.status == "running"


def test_engine_that_exits_0_or_answers_503_counts_as_crashed(
    docker_node: Node, sim_model: object, stack: str, eager_tasks: None
) -> None:
    # The warm-up is request 1; the engine dies after request 2 with exit code 0.
    env = sim_env(
        SIM_CRASH_AFTER_REQUESTS="2", SIM_CRASH_EXIT_CODE="0", SIM_CRASH_GRACE_SECONDS="1.5"
    )
    deployment = deploy(docker_node, sim_model, env=env)
    replica = Replica.objects.get(deployment=deployment)
    httpx.post(
        f"{replica.base_url}/v1/chat/completions",
        timeout=10,
        json={
            "model": "tiny-chat",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
        },
    )
    # During the grace period /health answers 503: out of routing at once.
    assert reconcile.reconcile_node(docker_node)["crashed"] == 1
    replica.refresh_from_db()
    assert replica.state == ReplicaState.CRASHED and "503" in replica.last_error


def test_crash_loop_fails_the_deployment_with_the_log_tail(
    docker_node: Node, sim_model: object, stack: str, eager_tasks: None, settings: object
) -> None:
    settings.TOLLGATE_MAX_CRASHES = 2
    settings.TOLLGATE_RESTART_BACKOFF_SECONDS = 0.1
    deployment = deploy(docker_node, sim_model, env=sim_env(SIM_LOAD_FAIL_EXIT_CODE="3"))
    replica = Replica.objects.get(deployment=deployment)
    assert replica.state == ReplicaState.CRASHED and replica.exit_code == 3
    op = Operation.objects.get(deployment=deployment, kind=OperationKind.DEPLOY)
    assert op.status == OperationStatus.FAILED and "exited with code 3" in op.error

    time.sleep(0.2)  # the 0.1 s backoff
    reconcile.reconcile_node(docker_node)
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.FAILED
    assert "crashed 2 times" in deployment.state_message
    assert "Loading safetensors checkpoint shards" in deployment.state_message  # the log tail
    # Failed stays failed: no more restarts.
    time.sleep(0.2)
    assert reconcile.reconcile_node(docker_node)["restarts"] == 0


def test_orphans_are_removed_and_foreign_containers_untouched(
    docker_node: Node, stack: str, settings: object
) -> None:
    dc = docker.from_env()
    labels = runtime.labels_for(stack, docker_node.name, deployment_id=999999, index=0)
    orphan = dc.containers.create(SIM_IMAGE, labels=labels, name=f"{stack}-orphan")
    foreign = dc.containers.create(
        SIM_IMAGE, name=f"{stack}-foreign", labels={runtime.LABEL_STACK: stack}
    )  # not managed: not ours
    try:
        settings.TOLLGATE_ORPHAN_GRACE_SECONDS = 3600.0
        assert reconcile.reconcile_node(docker_node)["orphans"] == 0  # still in its grace period
        settings.TOLLGATE_ORPHAN_GRACE_SECONDS = 0.0
        assert reconcile.reconcile_node(docker_node)["orphans"] == 1
        with pytest.raises(docker.errors.NotFound):
            orphan.reload()
        foreign.reload()
    finally:
        foreign.remove(force=True)


def test_a_container_removed_while_listing_is_left_out(
    docker_node: Node, stack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Docker lists ids, then each one is inspected: a container removed in between (an
    engine stopping while reconcile runs) is left out of the list instead of failing it."""
    dc = docker.from_env()
    labels = runtime.labels_for(stack, docker_node.name, deployment_id=999998, index=0)
    kept = dc.containers.create(SIM_IMAGE, labels=labels, name=f"{stack}-kept")
    gone = dc.containers.create(SIM_IMAGE, labels=labels, name=f"{stack}-gone")
    listing = dc.api.containers(
        all=True, filters={"label": runtime.label_filter(stack, docker_node.name)}
    )
    assert len(listing) == 2
    gone.remove(force=True)
    # Docker's answer to the list call, as it was before the removal.
    monkeypatch.setattr(dc.api, "containers", lambda *args, **kwargs: listing)
    try:
        assert [c.name for c in runtime.list_managed(dc, stack, docker_node.name)] == [kept.name]
    finally:
        kept.remove(force=True)


def test_the_same_deploy_task_delivered_twice_starts_one_container(
    docker_node: Node, sim_model: object, stack: str
) -> None:
    deployment = deploy(docker_node, sim_model)  # not eager: the task is only queued
    op = Operation.objects.get(deployment=deployment, kind=OperationKind.DEPLOY)
    assert op.status == OperationStatus.QUEUED and containers(stack) == []

    def deliver() -> None:
        try:
            tasks.deploy(op.pk)
        finally:
            connection.close()

    threads = [threading.Thread(target=deliver) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tasks.deploy(op.pk)  # and a third, late delivery
    assert len(containers(stack)) == 1
    assert Replica.objects.get(deployment=deployment).state == ReplicaState.READY


def test_a_second_deploy_operation_leaves_a_ready_replica_alone(
    docker_node: Node, sim_model: object, stack: str, eager_tasks: None
) -> None:
    deployment = deploy(docker_node, sim_model)
    first = containers(stack)[0].id
    op = operations.queue_operation(OperationKind.DEPLOY, deployment)
    assert Operation.objects.get(pk=op.pk).status == OperationStatus.SUCCEEDED
    assert [c.id for c in containers(stack)] == [first]


def test_disallowed_flag_or_image_is_a_400_and_creates_nothing(
    docker_node: Node,
    sim_model: object,
    stack: str,
    root: object,
    client_for: Callable,
    eager_tasks: None,
) -> None:
    api = client_for(root)
    base = {"name": "bad", "model": "tiny-chat", "node": docker_node.name, "image": SIM_IMAGE}
    for body in (
        {**base, "engine_args": {"api-key": "x"}},
        {**base, "engine_args": {"trust-remote-code": True}},
        {**base, "image": "evil/miner:latest"},
        {**base, "env": {"LD_PRELOAD": "/tmp/x.so"}},
    ):
        answer = api.post("/api/v1/deployments/", body, format="json")
        assert answer.status_code == 400, answer.content
    assert containers(stack) == [] and not Deployment.objects.exists()


def test_a_deployment_that_does_not_fit_is_a_400_with_the_arithmetic(
    docker_node: Node,
    stack: str,
    root: object,
    client_for: Callable,
    eager_tasks: None,
) -> None:
    api = client_for(root)
    api.post(
        "/api/v1/models/",
        {
            "served_name": "huge",
            "source": "org/huge",
            "params_billions": "405",
            "context_length": 131072,
        },
        format="json",
    )
    answer = api.post(
        "/api/v1/deployments/",
        {
            "name": "huge",
            "model": "huge",
            "node": docker_node.name,
            "image": SIM_IMAGE,
            "engine_args": {"max-num-seqs": 4},
        },
        format="json",
    )
    assert answer.status_code == 400
    (message,) = [e["message"] for e in answer.json()["errors"] if e["field"] == "memory"]
    assert "405 B params × 2 bytes (bf16) = 810.0 GB" in message
    assert "> 68.7 GB" in message  # the node's 64 GiB
    assert containers(stack) == [] and not Deployment.objects.exists()


def test_scale_up_and_down_through_the_api(
    docker_node: Node,
    sim_model: object,
    stack: str,
    root: object,
    client_for: Callable,
    eager_tasks: None,
) -> None:
    ensure_builtin_profiles()  # transactional tests empty the table the migration filled
    profile = EngineProfile.objects.get(name="simulator")
    services.create_deployment(
        None, name="tiny", model=sim_model, node=docker_node, profile=profile, env=sim_env()
    )
    api = client_for(root)
    assert api.patch("/api/v1/deployments/tiny/", {"replicas": 2}, format="json").status_code == 200
    assert sorted(c.labels[runtime.LABEL_REPLICA] for c in containers(stack)) == ["0", "1"]
    assert len(load_snapshot().routes[sim_model.pk]) == 2
    logs = api.get("/api/v1/deployments/tiny/logs/?replica=1&lines=50").json()
    assert "Loading safetensors checkpoint shards: 100% Completed | 4/4" in logs["log"]
    # What the node's worker publishes for web processes without Docker access.
    from deployments.fleet import publish_log_tails, read_log_tail

    assert publish_log_tails(docker_node) == 2
    replica = Replica.objects.get(deployment__name="tiny", index=1)
    assert "Loading safetensors checkpoint shards: 100% Completed | 4/4" in read_log_tail(
        replica.pk
    )
    assert api.patch("/api/v1/deployments/tiny/", {"replicas": 1}, format="json").status_code == 200
    assert [c.labels[runtime.LABEL_REPLICA] for c in containers(stack)] == ["0"]
    # The simulator profile's flags reached the engine.
    assert "--max-num-seqs" in containers(stack)[0].attrs["Args"]


def test_an_engine_gets_the_node_s_cores_minus_its_profile_s_headroom_or_its_own_cpus(
    docker_node: Node,
    sim_model: object,
    stack: str,
    root: object,
    client_for: Callable,
    eager_tasks: None,
) -> None:
    """What the cpu profile does on a small box, with the simulator's image: the worker asks
    Docker for the node's cores (no heartbeat came yet) and leaves the headroom free; a
    figure given through the API replaces the engine with one under that limit."""
    cores = docker.from_env().info()["NCPU"]
    profile = EngineProfile.objects.create(
        name="sim-capped", image=SIM_IMAGE, cpu_headroom=Decimal("0.5")
    )
    assert Node.objects.get(pk=docker_node.pk).cpu_count == 0
    deployment = deploy(docker_node, sim_model, profile=profile)
    (container,) = containers(stack)
    expected = round((cores - 0.5) * 1e9) if cores >= 1.5 else 0
    assert (container.attrs["HostConfig"]["NanoCpus"] or 0) == expected

    api = client_for(root)
    answer = api.patch("/api/v1/deployments/tiny/", {"cpus": 1}, format="json")
    assert answer.status_code == 200, answer.content[:300]
    (replaced,) = wait_for(
        lambda: [c for c in containers(stack) if c.id != container.id and c.status == "running"]
    )
    assert replaced.attrs["HostConfig"]["NanoCpus"] == 1_000_000_000
    replica = wait_for(
        lambda: Replica.objects.filter(deployment=deployment, state=ReplicaState.READY).first()
    )
    reply = httpx.post(
        f"{replica.base_url}/v1/chat/completions",
        timeout=10,
        json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert reply.status_code == 200


def test_missing_image_with_pulls_disabled_fails_the_operation_clearly(
    docker_node: Node, sim_model: object, stack: str, eager_tasks: None
) -> None:
    services.create_deployment(
        None,
        name="ghost",
        model=sim_model,
        node=docker_node,
        image="tollgate/engine-sim:does-not-exist",
        env=sim_env(),
    )
    op = Operation.objects.get(deployment__name="ghost")
    assert op.status == OperationStatus.FAILED
    assert "not on node" in op.error and "TOLLGATE_PULL_POLICY=never" in op.error
    assert containers(stack) == []


def test_a_deploy_whose_worker_died_is_taken_over_by_reconcile(
    docker_node: Node, sim_model: object, stack: str, eager_tasks: None, settings: object
) -> None:
    """The worker running a deploy was killed after creating the container: its operation
    stays "running" and the replica "starting" — until the operation's lease lapses."""
    from datetime import timedelta

    from django.utils import timezone

    settings.TOLLGATE_RESTART_BACKOFF_SECONDS = 0.5
    deployment = deploy(docker_node, sim_model)
    (first,) = containers(stack)
    replica = Replica.objects.get(deployment=deployment)
    # What a kill -9 leaves behind: a claimed operation without a living lease holder.
    gone = timezone.now() - timedelta(seconds=30)
    op = Operation.objects.create(
        kind="deploy", status="running", deployment=deployment, node=docker_node, started_at=gone
    )
    Operation.objects.filter(pk=op.pk).update(created_at=gone)
    Replica.objects.filter(pk=replica.pk).update(
        state=ReplicaState.STARTING, healthy=False, updated_at=gone
    )
    assert not get_redis().exists(operations.lease_key(op.pk))

    assert reconcile.reconcile_node(docker_node)["crashed"] == 1
    op.refresh_from_db()
    assert op.status == "failed" and "reconcile took over" in op.error
    wait_for(lambda: Replica.objects.get(pk=replica.pk).next_restart_at <= timezone.now(), 5)
    reconcile.reconcile_node(docker_node)
    replica.refresh_from_db()
    assert replica.state == ReplicaState.READY and replica.healthy
    (only,) = containers(stack)  # the leftover was replaced, not duplicated
    assert only.id != first.id


def test_a_running_operations_lease_is_renewed_while_it_works(settings: object) -> None:
    import time

    settings.TOLLGATE_OPERATION_LEASE_SECONDS = 0.6
    with operations.OperationLease(424242):
        time.sleep(1.2)  # twice the lease: only renewal keeps it
        assert get_redis().exists(operations.lease_key(424242))
    assert not get_redis().exists(operations.lease_key(424242))
