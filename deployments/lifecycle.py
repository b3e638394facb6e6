"""Deploy, scale, stop, restart and remove: each an Operation row run by a node's worker.

Services create the operation and queue its task after commit; the task (on the node's
own queue, so Docker is driven on its box) calls ``run_operation``. Every state change
is compare-and-set, so a task delivered twice never starts two containers.
"""

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import httpx
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from core.changes import publish_change
from core.keyspace import rkey
from core.redis import get_redis
from deployments import cluster, conf, engine, placement, runtime
from deployments.choices import (
    DeploymentState,
    DesiredState,
    OperationKind,
    OperationStatus,
    ReplicaState,
)
from deployments.models import Deployment, Node, Operation, Replica
from deployments.runtime import RuntimeFailure
from tenants.audit import Actor

log = logging.getLogger(__name__)

STARTABLE = [ReplicaState.PENDING, ReplicaState.STOPPED, ReplicaState.CRASHED, ReplicaState.FAILED]
ACTIVE = [ReplicaState.PULLING, ReplicaState.STARTING, ReplicaState.LOADING,
          ReplicaState.WARMING, ReplicaState.READY]


class EngineFailed(Exception):
    """An engine died or never became ready; carries its exit code and log tail."""

    def __init__(self, message: str, exit_code: int | None = None, log_tail: str = "") -> None:
        super().__init__(message)
        self.exit_code, self.log_tail = exit_code, log_tail


# --- Operations ---------------------------------------------------------------------------


def queue_operation(kind: str, deployment: Deployment | None, actor: Actor = None,
                    node: Node | None = None, model: Any = None, **detail: Any) -> Operation:
    """Record an operation and queue its task on the node's queue once this commits."""
    from deployments import tasks

    user = actor if actor is not None and getattr(actor, "is_authenticated", False) else None
    node = node or (deployment.node if deployment else None)
    op = Operation.objects.create(
        kind=kind, deployment=deployment, node=node, model=model, requested_by=user,
        detail=detail,
    )
    task = tasks.TASK_FOR_KIND[kind]
    queue = node.queue if node else "control"
    transaction.on_commit(lambda: task.apply_async(args=[op.pk], queue=queue))
    return op


def queue_on_nodes(kind: str, deployment: Deployment, actor: Actor = None,
                   **detail: Any) -> Operation | None:
    """Queue ``kind`` on each node that runs (or is to run) replicas of the deployment.

    Deploys, scales and restarts place replicas first (pinned node, or the node with the
    most free memory). Returns the first operation (None when there is nothing to do).
    """
    if kind in (OperationKind.DEPLOY, OperationKind.SCALE, OperationKind.RESTART):
        placement.place(deployment)
    node_ids = set(deployment.replica_set.exclude(node=None).values_list("node_id", flat=True))
    if deployment.node_id:
        node_ids.add(deployment.node_id)
    ops = [queue_operation(kind, deployment, actor, node=node, **detail)
           for node in Node.objects.filter(pk__in=node_ids).order_by("name")]
    if not ops and kind == OperationKind.STOP:
        Deployment.objects.filter(pk=deployment.pk, desired_state=DesiredState.STOPPED).update(
            state=DeploymentState.STOPPED, state_message="")
    return ops[0] if ops else None


def op_node(op: Operation) -> Node:
    """The node an operation acts on (its own, else the deployment's pinned node)."""
    return op.node or op.deployment.node


def on_node(deployment: Deployment, node: Node) -> Any:
    """The deployment's replicas this node runs (rows not yet placed count for the pinned node)."""
    rows = deployment.replica_set.all()
    if deployment.node_id == node.pk:
        return rows.filter(Q(node=node) | Q(node__isnull=True))
    return rows.filter(node=node)


def update_op(op: Operation, **fields: Any) -> None:
    """Save progress fields of a running operation (and keep the object in step)."""
    for name, value in fields.items():
        setattr(op, name, value)
    Operation.objects.filter(pk=op.pk).update(**fields)


def claim(op_id: int, kind: str) -> Operation | None:
    """The operation, now running, or None when another delivery already took it."""
    now = timezone.now()
    taken = Operation.objects.filter(pk=op_id, kind=kind, status=OperationStatus.QUEUED).update(
        status=OperationStatus.RUNNING, started_at=now
    )
    if not taken:
        log.info("operation %s already taken or finished: duplicate delivery ignored", op_id)
        return None
    return Operation.objects.select_related("deployment__model", "deployment__node",
                                            "deployment__profile", "node", "model").get(pk=op_id)


def finish(op: Operation, error: str = "") -> None:
    status = OperationStatus.FAILED if error else OperationStatus.SUCCEEDED
    fields: dict[str, Any] = {"status": status, "error": error[:20000], "finished_at": timezone.now()}
    if not error:
        fields["progress"] = 100.0
    update_op(op, **fields)


def lease_key(op_id: int) -> str:
    return rkey("op", op_id, "lease")


class OperationLease:
    """While an operation runs, a thread keeps its Redis lease alive. A worker killed
    mid-operation stops renewing; reconcile sees the lease lapse and takes over."""

    def __init__(self, op_id: int) -> None:
        self.key = lease_key(op_id)
        self.ttl = conf.get("TOLLGATE_OPERATION_LEASE_SECONDS")
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._renew, name=f"lease-op-{op_id}", daemon=True)

    def __enter__(self) -> "OperationLease":
        get_redis().set(self.key, b"1", px=int(self.ttl * 1000))
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)
        get_redis().delete(self.key)

    def _renew(self) -> None:
        while not self.stopped.wait(self.ttl / 3):
            try:
                get_redis().set(self.key, b"1", px=int(self.ttl * 1000))
            except Exception:  # noqa: BLE001 - Redis blip: the next round renews
                log.warning("could not renew %s", self.key, exc_info=True)


def run_operation(op_id: int, kind: str) -> None:
    """Run one queued operation to its end; failures end up in the operation row."""
    op = claim(op_id, kind)
    if op is None:
        return
    handler: Callable[[Operation], None] = HANDLERS[kind]
    with OperationLease(op.pk):
        _run(op, handler)


def _run(op: Operation, handler: Callable[[Operation], None]) -> None:
    op_id = op.pk
    try:
        handler(op)
    except (EngineFailed, RuntimeFailure, httpx.HTTPError) as exc:
        tail = getattr(exc, "log_tail", "")
        finish(op, f"{exc}\n--- last log lines ---\n{tail}" if tail else str(exc))
    except Exception as exc:
        log.exception("operation %s failed", op_id)
        finish(op, f"unexpected error: {exc}")
        raise
    else:
        finish(op)


# --- Deploy and scale ---------------------------------------------------------------------


def _deploy(op: Operation) -> None:
    deployment = op.deployment
    Deployment.objects.filter(pk=deployment.pk).exclude(state=DeploymentState.FAILED).update(
        state=DeploymentState.DEPLOYING
    )
    errors = []
    for index in _indexes(deployment, op_node(op)):
        try:
            start_replica(deployment, index, op)
        except (EngineFailed, RuntimeFailure) as exc:
            errors.append(exc)
    _scale_down(deployment, op)
    refresh_deployment_state(deployment)
    if errors:
        raise errors[0]


def _indexes(deployment: Deployment, node: Node) -> list[int]:
    """Replica indexes this node should run: every one when pinned here, else those placed here."""
    if deployment.node_id == node.pk and not placement.spans_nodes(deployment):
        return list(range(deployment.replicas))
    return sorted(on_node(deployment, node).filter(index__lt=deployment.replicas)
                  .values_list("index", flat=True))


def _restart(op: Operation) -> None:
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
    claimed = Replica.objects.filter(pk=replica.pk, state__in=STARTABLE).filter(
        Q(node=node) | Q(node__isnull=True)
    ).update(state=ReplicaState.PULLING, healthy=False, node=node, last_error="")
    if not claimed:
        # Another worker (or an earlier delivery of this task) has it in hand.
        replica.refresh_from_db()
        return replica
    replica.refresh_from_db()
    starter = engine.Starter(deployment, replica, op)
    try:
        starter.run()
    except (EngineFailed, RuntimeFailure) as exc:
        record_crash(replica, str(exc), getattr(exc, "exit_code", None),
                     getattr(exc, "log_tail", ""))
        raise
    return replica


def _scale(op: Operation) -> None:
    _deploy(op)


def _scale_down(deployment: Deployment, op: Operation) -> None:
    for replica in on_node(deployment, op_node(op)).filter(index__gte=deployment.replicas):
        drain_and_remove(replica, op)
        replica.delete()


# --- Crashes -------------------------------------------------------------------------------


def backoff_seconds(crash_count: int) -> float:
    """10 s after the first crash, doubling, at most 5 minutes (both settings)."""
    base = conf.get("TOLLGATE_RESTART_BACKOFF_SECONDS")
    return min(base * 2 ** max(crash_count - 1, 0), conf.get("TOLLGATE_RESTART_BACKOFF_MAX_SECONDS"))


def record_crash(replica: Replica, reason: str, exit_code: int | None, log_tail: str) -> None:
    """Mark a replica crashed, schedule its restart, or fail the deployment after too many."""
    with transaction.atomic():
        Replica.objects.filter(pk=replica.pk).update(
            state=ReplicaState.CRASHED, healthy=False, exit_code=exit_code,
            crash_count=F("crash_count") + 1, last_error=f"{reason}\n{log_tail}".strip()[-8000:],
        )
        replica.refresh_from_db()
        delay = backoff_seconds(replica.crash_count)
        replica.next_restart_at = timezone.now() + timedelta(seconds=delay)
        Replica.objects.filter(pk=replica.pk).update(next_restart_at=replica.next_restart_at)
        publish_change("replica", replica.pk)
        if replica.crash_count >= conf.get("TOLLGATE_MAX_CRASHES"):
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
        engine.wait_idle(replica.base_url, conf.get("TOLLGATE_DRAIN_TIMEOUT"))
    node = replica.node or replica.deployment.node
    if node is not None and replica.container_name:
        dc = runtime.client(node.docker_url)
        container = runtime.find(dc, replica.container_name)
        if container is not None and _is_ours(container, node):
            runtime.stop_and_remove(container, conf.get("TOLLGATE_STOP_GRACE_SECONDS"))
    Replica.objects.filter(pk=replica.pk).update(
        state=ReplicaState.STOPPED, healthy=False, container_id="", port=None, ready_at=None
    )
    if stop_worker and replica.worker_node_id and replica.worker_container_name:
        queue_operation(OperationKind.WORKER_STOP, None, node=replica.worker_node,
                        replica_id=replica.pk, container=replica.worker_container_name,
                        deployment_name=replica.deployment.name)


def _is_ours(container: Any, node: Node) -> bool:
    labels = container.labels or {}
    return (labels.get(runtime.LABEL_MANAGED) == "true"
            and labels.get(runtime.LABEL_STACK) == conf.get("TOLLGATE_STACK_ID")
            and labels.get(runtime.LABEL_NODE) == node.name)


def _stop(op: Operation) -> None:
    deployment = op.deployment
    Deployment.objects.filter(pk=deployment.pk).update(state=DeploymentState.STOPPING)
    for replica in on_node(deployment, op_node(op)):
        drain_and_remove(replica, op)
    # Stopped once no node has a live replica left (each node stops its own).
    if not deployment.replica_set.exclude(state=ReplicaState.STOPPED).exists():
        Deployment.objects.filter(pk=deployment.pk, desired_state=DesiredState.STOPPED).update(
            state=DeploymentState.STOPPED, state_message=""
        )


def _remove(op: Operation) -> None:
    deployment = op.deployment
    _stop(op)
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
    if deployment.desired_state != DesiredState.RUNNING or deployment.state == DeploymentState.FAILED:
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
    ).update(state=new, state_message="" if new == DeploymentState.READY else deployment.state_message)


HANDLERS: dict[str, Callable[[Operation], None]] = {
    OperationKind.DEPLOY: _deploy,
    OperationKind.SCALE: _scale,
    OperationKind.RESTART: _restart,
    OperationKind.STOP: _stop,
    OperationKind.REMOVE: _remove,
    OperationKind.WORKER_START: cluster.start_worker,
    OperationKind.WORKER_STOP: cluster.stop_worker,
}

