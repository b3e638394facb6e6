"""Deploy, scale, restart, stop and remove: what each operation does on its node.

Services record the operation and queue its task (deployments.operations); the task, on
the node's own queue so Docker is driven on its box, runs one of the handlers here. Every
state change is compare-and-set, so a task delivered twice never starts two containers.
"""

import logging
import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q, QuerySet
from django.utils import timezone

from core.changes import publish_change
from deployments import adapters, engine, placement, runtime
from deployments.choices import (
    DeploymentMode,
    DeploymentState,
    DesiredState,
    OperationKind,
    ReplicaState,
)
from deployments.models import Deployment, Node, Operation, Replica
from deployments.operations import EngineFailed, op_node, queue_operation, update_op
from deployments.runtime import RuntimeFailure

log = logging.getLogger(__name__)
# How long an on-demand start waits for evicted engines on its node to let go of memory.
EVICTION_WAIT_SECONDS = 300.0

STARTABLE = [ReplicaState.PENDING, ReplicaState.STOPPED, ReplicaState.CRASHED, ReplicaState.FAILED]
ACTIVE = [
    ReplicaState.PULLING,
    ReplicaState.STARTING,
    ReplicaState.LOADING,
    ReplicaState.WARMING,
    ReplicaState.READY,
]


def on_node(deployment: Deployment, node: Node) -> Any:
    """The deployment's replicas this node runs (rows not yet placed count for the pinned node)."""
    rows = deployment.replica_set.all()
    if deployment.node_id == node.pk:
        return rows.filter(Q(node=node) | Q(node__isnull=True))
    return rows.filter(node=node)


# --- Deploy and scale ---------------------------------------------------------------------


def deploy(op: Operation) -> None:
    """Start this node's missing replicas and remove those beyond the replica count."""
    deployment = op.deployment
    Deployment.objects.filter(pk=deployment.pk).exclude(state=DeploymentState.FAILED).update(
        state=DeploymentState.DEPLOYING
    )
    if deployment.on_demand:
        wait_for_evictions(op, op_node(op))
    errors = []
    for index in _indexes(deployment, op_node(op)):
        try:
            start_replica(deployment, index, op)
        except (EngineFailed, RuntimeFailure) as exc:
            errors.append(exc)
    _scale_down(deployment, op)
    refresh_deployment_state(deployment)
    adapters.check_waiting_adapters(deployment)
    if errors:
        raise errors[0]


def wait_for_evictions(op: Operation, node: Node) -> None:
    """Until no engine on the node belongs to an on-demand deployment put to sleep (to make
    room for this one, or for another start): their memory must be free before an engine
    asks for it (deployments/demand.py decided with it counted as free)."""
    deadline = time.monotonic() + EVICTION_WAIT_SECONDS
    while _evicted_live(node):
        if time.monotonic() > deadline:
            raise EngineFailed(
                f"Engines put to sleep on {node.name} did not stop within "
                f"{EVICTION_WAIT_SECONDS:.0f} s; not starting another beside them."
            )
        update_op(op, phase="evict", message=f"waiting for evicted engines on {node.name}")
        time.sleep(settings.TOLLGATE_ENGINE_POLL_SECONDS)


def _evicted_live(node: Node) -> bool:
    return (
        Replica.objects.filter(node=node, deployment__mode=DeploymentMode.ON_DEMAND)
        .filter(deployment__awake=False)
        .exclude(state__in=placement.IDLE)  # those hold no memory
        .exists()
    )


def _indexes(deployment: Deployment, node: Node) -> list[int]:
    """Replica indexes this node should run: every one when pinned here, else those placed here."""
    if deployment.node_id == node.pk and not placement.spans_nodes(deployment):
        return list(range(deployment.replicas))
    return sorted(
        on_node(deployment, node)
        .filter(index__lt=deployment.replicas)
        .values_list("index", flat=True)
    )


def restart(op: Operation) -> None:
    """Replace this node's replicas (or the one ``detail["replica"]`` names), one by one."""
    deployment = op.deployment
    mine = _indexes(deployment, op_node(op))
    indexes = [op.detail["replica"]] if "replica" in op.detail else mine
    for index in indexes:
        replica = Replica.objects.filter(deployment=deployment, index=index).first()
        if replica and replica.state not in (ReplicaState.CRASHED, ReplicaState.PENDING):
            # The new start replaces a Ray worker container itself: no separate stop.
            drain_and_remove(replica, op, stop_worker=False)
        start_replica(deployment, index, op)
    refresh_deployment_state(deployment)


def start_replica(deployment: Deployment, index: int, op: Operation) -> Replica:
    """Bring one replica from nothing to ready; does nothing if another run owns it."""
    node = op_node(op)
    replica, _ = Replica.objects.get_or_create(
        deployment=deployment, index=index, defaults={"node": node}
    )
    # Only the node the replica is placed on starts it (it may have moved meanwhile).
    claimed = (
        Replica.objects.filter(pk=replica.pk, state__in=STARTABLE)
        .filter(Q(node=node) | Q(node__isnull=True))
        .update(state=ReplicaState.PULLING, healthy=False, node=node, last_error="")
    )
    if not claimed:
        # Another worker (or an earlier delivery of this task) has it in hand.
        replica.refresh_from_db()
        return replica
    replica.refresh_from_db()
    starter = engine.Starter(deployment, replica, op)
    try:
        starter.run()
    except (EngineFailed, RuntimeFailure) as exc:
        record_crash(
            replica, str(exc), getattr(exc, "exit_code", None), getattr(exc, "log_tail", "")
        )
        raise
    return replica


def scale(op: Operation) -> None:
    """A new replica count: the same convergence as a deploy."""
    deploy(op)


def _scale_down(deployment: Deployment, op: Operation) -> None:
    for replica in on_node(deployment, op_node(op)).filter(index__gte=deployment.replicas):
        drain_and_remove(replica, op)
        replica.delete()


# --- Crashes -------------------------------------------------------------------------------


def backoff_seconds(crash_count: int) -> float:
    """10 s after the first crash, doubling, at most 5 minutes (both settings)."""
    base = settings.TOLLGATE_RESTART_BACKOFF_SECONDS
    return min(base * 2 ** max(crash_count - 1, 0), settings.TOLLGATE_RESTART_BACKOFF_MAX_SECONDS)


def record_crash(replica: Replica, reason: str, exit_code: int | None, log_tail: str) -> None:
    """Mark a replica crashed, schedule its restart, or fail the deployment after too many."""
    with transaction.atomic():
        Replica.objects.filter(pk=replica.pk).update(
            state=ReplicaState.CRASHED,
            healthy=False,
            exit_code=exit_code,
            crash_count=F("crash_count") + 1,
            last_error=f"{reason}\n{log_tail}".strip()[-8000:],
        )
        replica.refresh_from_db()
        delay = backoff_seconds(replica.crash_count)
        replica.next_restart_at = timezone.now() + timedelta(seconds=delay)
        Replica.objects.filter(pk=replica.pk).update(next_restart_at=replica.next_restart_at)
        publish_change("replica", replica.pk)
        if replica.crash_count >= settings.TOLLGATE_MAX_CRASHES:
            message = (
                f"Replica {replica.index} crashed {replica.crash_count} times; not restarting. "
                f"Last: {reason}\n--- last log lines ---\n{log_tail}"
            )
            Deployment.objects.filter(pk=replica.deployment_id).update(
                state=DeploymentState.FAILED, state_message=message[-8000:]
            )
            publish_change("deployment", replica.deployment_id)
    log.warning("replica %s crashed (%s); crash %s", replica, reason, replica.crash_count)


# --- Stop and remove ----------------------------------------------------------------------


def drain_and_remove(replica: Replica, op: Operation | None, stop_worker: bool = True) -> None:
    """Out of routing, in-flight requests finish (up to a timeout), then stop and remove.

    A two-box replica's Ray head goes first; its worker is then stopped on its own node.
    """
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.DRAINING, healthy=False)
    publish_change("replica", replica.pk)
    if op is not None:
        update_op(op, phase="draining", message=f"draining replica {replica.index}")
    if replica.base_url:
        engine.wait_idle(replica.base_url, settings.TOLLGATE_DRAIN_TIMEOUT)
    node = replica.node or replica.deployment.node
    if node is not None and replica.container_name:
        dc = runtime.client(node.docker_url)
        container = runtime.find(dc, replica.container_name)
        if container is not None and _is_ours(container, node):
            runtime.stop_and_remove(container, settings.TOLLGATE_STOP_GRACE_SECONDS)
    mark_stopped(Replica.objects.filter(pk=replica.pk))
    if stop_worker and replica.worker_node_id and replica.worker_container_name:
        queue_operation(
            OperationKind.WORKER_STOP,
            None,
            node=replica.worker_node,
            replica_id=replica.pk,
            container=replica.worker_container_name,
            deployment_name=replica.deployment.name,
        )


def mark_stopped(replicas: QuerySet[Replica]) -> int:
    """Record replicas as stopped: out of routing, no container, no port."""
    return replicas.update(
        state=ReplicaState.STOPPED, healthy=False, container_id="", port=None, ready_at=None
    )


def _is_ours(container: Any, node: Node) -> bool:
    labels = container.labels or {}
    return (
        labels.get(runtime.LABEL_MANAGED) == "true"
        and labels.get(runtime.LABEL_STACK) == settings.TOLLGATE_STACK_ID
        and labels.get(runtime.LABEL_NODE) == node.name
    )


def stop(op: Operation) -> None:
    """Drain and remove this node's replicas; the deployment is stopped once none is left."""
    deployment = op.deployment
    Deployment.objects.filter(pk=deployment.pk).update(state=DeploymentState.STOPPING)
    for replica in on_node(deployment, op_node(op)):
        drain_and_remove(replica, op)
    mark_stopped_when_done(deployment)


def mark_stopped_when_done(deployment: Deployment) -> None:
    """Stopped once no node has a live replica left (each node stops its own): a deployment
    asked to stop, or an on-demand one put to sleep."""
    if not deployment.replica_set.exclude(state=ReplicaState.STOPPED).exists():
        asleep = Q(mode=DeploymentMode.ON_DEMAND, awake=False)
        Deployment.objects.filter(Q(desired_state=DesiredState.STOPPED) | asleep).filter(
            pk=deployment.pk
        ).update(state=DeploymentState.STOPPED, state_message="")


def remove(op: Operation) -> None:
    """Stop this node's replicas and delete their rows; the last node deletes the deployment."""
    deployment = op.deployment
    stop(op)
    with transaction.atomic():
        on_node(deployment, op_node(op)).delete()
        update_op(op, detail={**op.detail, "deployment_name": deployment.name}, deployment=None)
        # The last node to finish removes the deployment itself.
        if not Replica.objects.filter(deployment_id=deployment.pk).exists():
            Deployment.objects.filter(pk=deployment.pk).delete()
    publish_change("deployment", deployment.pk)


def refresh_deployment_state(deployment: Deployment) -> None:
    """Ready when every replica is, degraded when some are; failed stays failed."""
    deployment.refresh_from_db()
    if not deployment.wanted_running or deployment.state == DeploymentState.FAILED:
        return
    states = list(deployment.replica_set.values_list("state", flat=True))
    ready = states.count(ReplicaState.READY)
    if ready and ready >= deployment.replicas:
        new = DeploymentState.READY
    elif ready:
        new = DeploymentState.DEGRADED
    elif any(s in ACTIVE for s in states):
        new = DeploymentState.DEPLOYING
    else:
        new = DeploymentState.DEGRADED if states else DeploymentState.PENDING
    Deployment.objects.filter(pk=deployment.pk).exclude(state=DeploymentState.FAILED).exclude(
        state=new
    ).update(
        state=new, state_message="" if new == DeploymentState.READY else deployment.state_message
    )
