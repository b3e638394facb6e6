"""Reconcile: make each node's containers match what the deployments ask for.

Runs every few seconds per node (on that node's queue). It finds Tollgate's containers
by label, marks replicas whose engine died (any exit code, or ``/health`` 503) crashed,
queues restarts once their backoff has passed, starts replicas that should exist,
removes orphan containers after a grace period, and never touches other containers.
A node only handles the replicas placed on it (and the Ray workers it hosts); placing
unpinned replicas is done once, fleet-wide, by ``place_all`` on the control queue.
"""

import logging
from datetime import timedelta

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from core.changes import publish_change
from core.redis import get_redis
from deployments import engine, lifecycle, placement, runtime
from deployments.choices import (
    ContainerRole,
    DeploymentMode,
    DeploymentState,
    DesiredState,
    NodeStatus,
    OperationKind,
    OperationStatus,
    ReplicaState,
)
from deployments.models import Deployment, Node, Operation, Replica
from deployments.operations import lease_key, queue_operation

log = logging.getLogger(__name__)
IN_FLIGHT = [
    ReplicaState.PULLING,
    ReplicaState.STARTING,
    ReplicaState.LOADING,
    ReplicaState.WARMING,
    ReplicaState.DRAINING,
]


def reconcile_node(node: Node) -> dict[str, int]:
    """One pass over a node; returns counts of what it did (for logs and tests)."""
    dc = runtime.client(node.docker_url)
    stack = settings.TOLLGATE_STACK_ID
    engines: dict[tuple[str, str], object] = {}
    workers: dict[tuple[str, str], object] = {}
    for c in runtime.list_managed(dc, stack, node.name):
        role = c.labels.get(runtime.LABEL_ROLE)
        key = (c.labels.get(runtime.LABEL_DEPLOYMENT), c.labels.get(runtime.LABEL_REPLICA))
        if role in (ContainerRole.ENGINE, ContainerRole.HEAD):
            engines[key] = c
        elif role == ContainerRole.WORKER:
            workers[key] = c
    done = {"crashed": 0, "restarts": 0, "starts": 0, "orphans": 0, "stops": 0}
    online = Node.objects.filter(pk=node.pk, status=NodeStatus.ONLINE).exists()
    expected: set[tuple[str, str]] = set()
    expected_workers: set[tuple[str, str]] = set()
    deployments = (
        Deployment.objects.filter(Q(node=node) | Q(replica_set__node=node), external=False)
        .distinct()
        .select_related("model", "node", "profile")
    )
    for deployment in deployments:
        for replica in lifecycle.on_node(deployment, node).select_related("worker_node"):
            key = (str(deployment.pk), str(replica.index))
            expected.add(key)
            _observe(replica, engines.get(key), done, online)
        _converge(deployment, node, done)
    for replica in Replica.objects.filter(worker_node=node).select_related("deployment"):
        key = (str(replica.deployment_id), str(replica.index))
        expected_workers.add(key)
        _observe_worker(replica, workers.get(key), done)
    orphans = [c for k, c in engines.items() if k not in expected]
    orphans += [c for k, c in workers.items() if k not in expected_workers]
    for container in orphans:
        if _older_than(container, settings.TOLLGATE_ORPHAN_GRACE_SECONDS):
            # Also what a returning node finds of replicas that were placed elsewhere.
            log.warning("removing orphan container %s", container.name)
            runtime.stop_and_remove(container, settings.TOLLGATE_STOP_GRACE_SECONDS)
            done["orphans"] += 1
    return done


def _observe_worker(replica: Replica, container: object | None, done: dict[str, int]) -> None:
    """A ready two-box replica whose Ray worker died has crashed (vLLM cannot go on)."""
    if replica.state != ReplicaState.READY or not replica.worker_container_name:
        return
    if container is not None and container.status == "running":
        return
    code = runtime.exit_code(container) if container is not None else None
    tail = _tail(container)
    lifecycle.record_crash(
        replica,
        f"the Ray worker on {replica.worker_node_id and replica.worker_node}"
        f" {'exited with code ' + str(code) if code is not None else 'disappeared'}",
        code,
        tail,
    )
    done["crashed"] += 1


def _tail(container: object | None) -> str:
    """The last log lines of a dead engine (none when its container is gone)."""
    return runtime.logs_tail(container, settings.TOLLGATE_LOG_TAIL_LINES) if container else ""


def _older_than(container: object, seconds: float) -> bool:
    return runtime.created_at(container) < timezone.now() - timedelta(seconds=seconds)


def _observe(
    replica: Replica, container: object | None, done: dict[str, int], online: bool = True
) -> None:
    """Compare one replica's row with its container; record a crash when the engine died."""
    if replica.state == ReplicaState.READY:
        health = None
        if container is not None and container.status == "running" and replica.base_url:
            health = engine.probe_health(replica.base_url)
        observed = runtime.replica_state_for(container.status if container else None, health)
        if observed in (ReplicaState.CRASHED, runtime.MISSING):
            code = runtime.exit_code(container) if container is not None else None
            tail = _tail(container)
            reason = (
                f"engine exited with code {code}"
                if code is not None
                else "engine /health answered 503"
                if health and health >= 500
                else "engine container disappeared"
            )
            lifecycle.record_crash(replica, reason, code, tail)
            done["crashed"] += 1
        elif observed == ReplicaState.LOADING:
            # Running but not answering: keep it out of routing until it answers again.
            _set_health(replica, False)
        elif online:
            # Not while the node counts as unreachable: the heartbeat brings it back first.
            _set_health(replica, True)
            _forgive(replica)
    elif replica.state in IN_FLIGHT and _quiet(replica) and not _operation_running(replica):
        # A worker died mid-start (its operation's lease lapsed, or the start is far past its
        # timeout): nobody will finish this start, so count it as a crash and restart it.
        lifecycle.record_crash(replica, f"start abandoned in state {replica.state}", None, "")
        done["crashed"] += 1


def _set_health(replica: Replica, healthy: bool) -> None:
    rows = Replica.objects.filter(pk=replica.pk, state=ReplicaState.READY).exclude(healthy=healthy)
    if healthy:
        # Checked again at the write: a pass that began before its node was revoked or
        # found unreachable must not route the replica back in.
        rows = rows.filter(node__status=NodeStatus.ONLINE).exclude(
            worker_node__status__in=[s for s in NodeStatus if s != NodeStatus.ONLINE]
        )
    updated = rows.update(healthy=healthy)
    Replica.objects.filter(pk=replica.pk).update(last_health_at=timezone.now())
    if updated:
        publish_change("replica", replica.pk)


def _forgive(replica: Replica) -> None:
    # A replica that stayed up long enough has its earlier crashes forgiven.
    if (
        replica.crash_count
        and replica.ready_at
        and replica.ready_at
        < timezone.now() - timedelta(seconds=settings.TOLLGATE_CRASH_RESET_SECONDS)
    ):
        Replica.objects.filter(pk=replica.pk).update(crash_count=0)


def _quiet(replica: Replica) -> bool:
    # Not touched for a moment: a start that is still being written is left alone.
    return replica.updated_at < timezone.now() - timedelta(seconds=10)


def _operation_running(replica: Replica) -> bool:
    return _operation_running_for(replica.deployment, replica.node)


def _converge(deployment: Deployment, node: Node, done: dict[str, int]) -> None:
    """Queue what brings this node's share of the deployment to its desired state."""
    deployment.refresh_from_db()
    if _operation_running_for(deployment, node):
        return
    mine = lifecycle.on_node(deployment, node)
    if not deployment.wanted_running:  # stopped, or on demand and asleep
        live = mine.exclude(state=ReplicaState.STOPPED)
        if live.exists() and deployment.state != DeploymentState.STOPPING:
            queue_operation(OperationKind.STOP, deployment, node=node)
            done["stops"] += 1
        return
    if deployment.state == DeploymentState.FAILED:
        return
    if deployment.node_id == node.pk:
        # Pinned here: rows for missing replicas (and a worker node for a Ray group).
        try:
            placement.place(deployment)
        except placement.NoRoom as exc:
            log.warning("%s: %s", deployment, exc)
    now = timezone.now()
    due = mine.filter(
        Q(next_restart_at__isnull=True) | Q(next_restart_at__lte=now),
        state__in=[ReplicaState.CRASHED, ReplicaState.FAILED],
        index__lt=deployment.replicas,
    )
    restarted = 0
    for replica in due:
        # Claim the restart: only one reconcile pass may queue it.
        claimed = Replica.objects.filter(pk=replica.pk, state=replica.state).update(
            state=ReplicaState.PENDING
        )
        if claimed:
            queue_operation(OperationKind.RESTART, deployment, node=node, replica=replica.index)
            restarted += 1
    done["restarts"] += restarted
    if restarted:
        return
    pending = mine.filter(
        state__in=[ReplicaState.PENDING, ReplicaState.STOPPED], index__lt=deployment.replicas
    )
    extra = mine.filter(index__gte=deployment.replicas)
    if pending.exists() or extra.exists():
        queue_operation(OperationKind.DEPLOY, deployment, node=node)
        done["starts"] += 1
    else:
        lifecycle.refresh_deployment_state(deployment)


def _operation_running_for(deployment: Deployment, node: Node | None = None) -> bool:
    """Is an operation of this deployment (on this node) queued or running on a live worker?

    A queued one no worker picked up within the start timeout no longer counts; a running
    one whose worker stopped renewing its lease (killed mid-operation) is failed here, so
    reconcile takes over at once instead of waiting for the broker to redeliver its task."""
    since = timezone.now() - timedelta(seconds=settings.TOLLGATE_ENGINE_READY_TIMEOUT + 120)
    ops = deployment.operations.filter(
        status__in=[OperationStatus.QUEUED, OperationStatus.RUNNING], created_at__gte=since
    ).exclude(kind=OperationKind.WORKER_START)  # it runs as long as its head's start
    if node is not None:
        ops = ops.filter(Q(node=node) | Q(node__isnull=True))
    alive = False
    for op in ops:
        if op.status == OperationStatus.RUNNING and _lease_lapsed(op):
            _abandon(op)
        else:
            alive = True
    return alive


def _lease_lapsed(op: Operation) -> bool:
    recently = timezone.now() - timedelta(seconds=5)  # claimed a moment ago: lease being set
    return bool(
        op.started_at and op.started_at < recently and not get_redis().exists(lease_key(op.pk))
    )


def _abandon(op: Operation) -> None:
    failed = Operation.objects.filter(pk=op.pk, status=OperationStatus.RUNNING).update(
        status=OperationStatus.FAILED,
        finished_at=timezone.now(),
        error=(
            "The worker running this operation stopped (killed or restarted); reconcile took over."
        ),
    )
    if failed:
        log.warning("operation %s lost its worker; reconcile takes over", op.pk)


# --- Fleet-wide, on the control queue ------------------------------------------------------


def place_all() -> int:
    """Place unpinned replicas (new ones, and those of nodes that became unreachable) and
    queue their start on their new node; returns how many moved."""
    moved = 0
    running = (
        Deployment.objects.filter(desired_state=DesiredState.RUNNING, external=False)
        .exclude(state=DeploymentState.FAILED)
        .exclude(mode=DeploymentMode.ON_DEMAND, awake=False)  # asleep: placed when woken
        .select_related("model", "node", "profile")
    )
    for deployment in running:
        if deployment.node_id and not placement.spans_nodes(deployment):
            continue  # pinned: its node's reconcile handles it
        try:
            replicas = placement.place(deployment)
        except placement.NoRoom as exc:
            Deployment.objects.filter(pk=deployment.pk).update(state_message=str(exc)[:2000])
            continue
        for node_id in sorted({r.node_id for r in replicas}):
            queue_operation(OperationKind.DEPLOY, deployment, node=Node.objects.get(pk=node_id))
        moved += len(replicas)
    return moved
