"""Tensor parallelism over two nodes with vLLM's Ray backend.

One replica is a group: a Ray head container on the replica's node that starts Ray, waits
for the worker node and then runs ``vllm serve … --tensor-parallel-size 2
--distributed-executor-backend ray``; and a Ray worker container on ``replica.worker_node``
that joins the head and blocks. Each container is created by its own node's worker (the
head's start queues the worker's start on the worker node's queue). How an image starts
Ray comes from its engine profile (``EngineProfile.cluster``), so nothing here knows which
image runs; the interconnect environment comes from the node settings.

Stop order: the head drains and goes first, then the worker.
"""

import logging
import time
from typing import Any

from django.conf import settings
from django.utils import timezone

from deployments import runtime
from deployments.choices import ContainerRole, OperationKind, OperationStatus, ReplicaState
from deployments.engine_env import engine_environment
from deployments.models import Deployment, Node, Operation, Replica
from deployments.operations import EngineFailed, queue_operation, update_op

log = logging.getLogger(__name__)
HOST_NETWORK = "host"


def settings_for(deployment: Deployment) -> dict[str, Any]:
    """The profile's cluster recipe (network, Ray port, head and worker entrypoints)."""
    cluster = deployment.profile.cluster if deployment.profile_id and deployment.profile else {}
    return {"network": "bridge", "ray_port": 6379, **(cluster or {})}


def node_env(node: Node) -> dict[str, str]:
    """What each node of a group needs (the DGX Spark facts): its address on the
    interconnect, the interface NCCL/UCX/Gloo use, and Ray's memory monitor relaxed on
    unified memory (Ray would count GPU memory as host memory and kill workers)."""
    env = {"VLLM_HOST_IP": node.cluster_address}
    if node.high_speed_interface:
        env.update(
            NCCL_SOCKET_IFNAME=node.high_speed_interface,
            GLOO_SOCKET_IFNAME=node.high_speed_interface,
            UCX_NET_DEVICES=node.high_speed_interface,
        )
    if node.unified_memory:
        env["RAY_memory_usage_threshold"] = "1.0"
    return env


def _fill(parts: list[str], **values: Any) -> list[str]:
    return [str(part).format(**values) for part in parts]


def head_entrypoint(deployment: Deployment) -> list[str]:
    cluster = settings_for(deployment)
    timeout = int(settings.TOLLGATE_RAY_JOIN_TIMEOUT)
    return _fill(
        cluster["head_entrypoint"],
        ray_port=cluster["ray_port"],
        workers=1,
        nodes=2,
        timeout=timeout,
    )


def head_command(argv: list[str]) -> list[str]:
    """``vllm serve`` argv with Ray as the executor (the size comes from the flags)."""
    if "--distributed-executor-backend" not in argv:
        argv = [*argv, "--distributed-executor-backend", "ray"]
    return argv


def head_address(deployment: Deployment, replica: Replica) -> str:
    """Where the worker reaches the head: the head node's interconnect address with host
    networking; the head container's name on a shared bridge network otherwise."""
    if settings_for(deployment)["network"] == HOST_NETWORK:
        return replica.node.cluster_address
    return replica.container_name


def worker_name(replica: Replica) -> str:
    return f"{replica.container_name}-ray-worker"


def queue_worker(replica: Replica) -> Operation:
    """Ask the worker node's own worker to start this replica's Ray worker container."""
    return queue_operation(
        OperationKind.WORKER_START,
        replica.deployment,
        node=replica.worker_node,
        replica_id=replica.pk,
        head=head_address(replica.deployment, replica),
    )


def worker_failure(op_id: int) -> str:
    """The error of a failed worker start ("" while it runs or when it succeeded)."""
    op = Operation.objects.filter(pk=op_id).values("status", "error").first()
    if op and op["status"] == OperationStatus.FAILED:
        return op["error"]
    return ""


# --- On the worker node ---------------------------------------------------------------------


def start_worker(op: Operation) -> None:
    """Create and start the Ray worker container, then watch it until the head is ready.

    A worker that exits (it could not reach the head: wrong interface, address or
    firewall) fails this operation with its log tail; the head's start reports it.
    """
    replica = (
        Replica.objects.select_related(
            "deployment__model", "deployment__profile", "node", "worker_node"
        )
        .filter(pk=op.detail["replica_id"])
        .first()
    )
    if replica is None or replica.worker_node_id != op.node_id:
        update_op(op, message="the replica moved or is gone; nothing to start")
        return
    deployment, node = replica.deployment, op.node
    dc = runtime.client(node.docker_url)
    stack, name = settings.TOLLGATE_STACK_ID, worker_name(replica)
    _remove_stale(dc, name, node)
    cluster = settings_for(deployment)
    entrypoint = _fill(
        cluster["worker_entrypoint"],
        head_address=op.detail["head"],
        ray_port=cluster["ray_port"],
        timeout=int(settings.TOLLGATE_RAY_JOIN_TIMEOUT),
    )
    spec = runtime.engine_spec(
        name=name,
        image=deployment.image,
        command=[],
        entrypoint=entrypoint,
        env={**node_env(node), **engine_environment(deployment, node), **_own(node)},
        labels=runtime.labels_for(
            stack, node.name, deployment.pk, replica.index, role=ContainerRole.WORKER
        ),
        gpus=node.gpu_count > 0,
        engine_host=node.engine_host,
        ports=(),
        host_network=cluster["network"] == HOST_NETWORK,
        join_network=cluster["network"] != HOST_NETWORK,
        cpus=deployment.cpu_limit(node.cpu_count or runtime.cpu_count(dc)),
    )
    update_op(op, phase="create", message=f"starting the Ray worker of {replica} on {node.name}")
    container = runtime.create_engine(dc, spec)
    Replica.objects.filter(pk=replica.pk).update(
        worker_container_name=name, updated_at=timezone.now()
    )
    runtime.start(container)
    update_op(op, phase="joined", message=f"Ray worker {name} running on {node.name}")
    deadline = time.monotonic() + settings.TOLLGATE_ENGINE_READY_TIMEOUT
    while time.monotonic() < deadline:
        current = runtime.refresh(container)
        if current is None or current.status != "running":
            code = runtime.exit_code(container) if current is not None else None
            tail = runtime.logs_tail(container, settings.TOLLGATE_LOG_TAIL_LINES) if current else ""
            raise EngineFailed(f"the Ray worker on {node.name} exited with code {code}", code, tail)
        state = Replica.objects.filter(pk=replica.pk).values_list("state", flat=True).first()
        if state == ReplicaState.READY:
            return
        if state in (None, ReplicaState.CRASHED, ReplicaState.FAILED):
            # The head gave up (its start failed and reported why): this worker is useless.
            runtime.stop_and_remove(container, 0)
            return
        if state in (ReplicaState.STOPPED, ReplicaState.DRAINING):
            return  # being stopped: the stop removes this worker after the head
        time.sleep(settings.TOLLGATE_ENGINE_POLL_SECONDS)
    raise EngineFailed("the head never became ready", None, "")


def _own(node: Node) -> dict[str, str]:
    # VLLM_HOST_IP is per node: a deployment-wide value must not override it.
    return {"VLLM_HOST_IP": node.cluster_address}


def _remove_stale(dc: Any, name: str, node: Node) -> None:
    stale = runtime.find(dc, name)
    if stale is None:
        return
    labels = stale.labels or {}
    if (
        labels.get(runtime.LABEL_STACK) != settings.TOLLGATE_STACK_ID
        or labels.get(runtime.LABEL_NODE) != node.name
    ):
        raise runtime.RuntimeFailure(f"a container named {name} exists and is not Tollgate's")
    runtime.stop_and_remove(stale, 0)


def stop_worker(op: Operation) -> None:
    """Stop and remove a Ray worker container (after its head is gone)."""
    node = op.node
    dc = runtime.client(node.docker_url)
    container = runtime.find(dc, op.detail["container"])
    labels = (container.labels or {}) if container is not None else {}
    ours = (
        labels.get(runtime.LABEL_STACK) == settings.TOLLGATE_STACK_ID
        and labels.get(runtime.LABEL_NODE) == node.name
        and labels.get(runtime.LABEL_ROLE) == ContainerRole.WORKER
    )
    if container is not None and ours:
        runtime.stop_and_remove(container, settings.TOLLGATE_STOP_GRACE_SECONDS)
    Replica.objects.filter(
        pk=op.detail["replica_id"], worker_container_name=op.detail["container"]
    ).update(worker_container_name="")
    update_op(op, message=f"Ray worker {op.detail['container']} removed from {node.name}")
