"""Reconcile: make each node's containers match what the deployments ask for.

Runs every few seconds per node (on that node's queue). It finds Tollgate's containers
by label, marks replicas whose engine died (any exit code, or ``/health`` 503) crashed,
queues restarts once their backoff has passed, starts replicas that should exist,
removes orphan containers after a grace period, and never touches other containers.
"""

import logging
from datetime import timedelta

from django.db.models import Q
from django.utils import timezone

from deployments import conf, engine, lifecycle, runtime
from deployments.choices import (
    DeploymentState,
    DesiredState,
    OperationKind,
    OperationStatus,
    ReplicaState,
)
from deployments.models import Deployment, Node, Replica
from gateway.invalidation import publish_change

log = logging.getLogger(__name__)
IN_FLIGHT = [ReplicaState.PULLING, ReplicaState.STARTING, ReplicaState.LOADING,
             ReplicaState.WARMING, ReplicaState.DRAINING]


def reconcile_node(node: Node) -> dict[str, int]:
    """One pass over a node; returns counts of what it did (for logs and tests)."""
    dc = runtime.client(node.docker_url)
    stack = conf.get("TOLLGATE_STACK_ID")
    containers = {
        (c.labels.get(runtime.LABEL_DEPLOYMENT), c.labels.get(runtime.LABEL_REPLICA)): c
        for c in runtime.list_managed(dc, stack, node.name, **{runtime.LABEL_ROLE: "engine"})
    }
    done = {"crashed": 0, "restarts": 0, "starts": 0, "orphans": 0, "stops": 0}
    expected: set[tuple[str, str]] = set()
    deployments = Deployment.objects.filter(node=node, external=False).select_related("model")
    for deployment in deployments:
        for replica in deployment.replica_set.all():
            key = (str(deployment.pk), str(replica.index))
            expected.add(key)
            _observe(replica, containers.get(key), done)
        _converge(deployment, done)
    for key, container in containers.items():
        if key not in expected and _older_than(container, conf.get("TOLLGATE_ORPHAN_GRACE_SECONDS")):
            log.warning("removing orphan container %s", container.name)
            runtime.stop_and_remove(container, conf.get("TOLLGATE_STOP_GRACE_SECONDS"))
            done["orphans"] += 1
    return done


def _older_than(container: object, seconds: float) -> bool:
    return runtime.created_at(container) < timezone.now() - timedelta(seconds=seconds)


def _observe(replica: Replica, container: object | None, done: dict[str, int]) -> None:
    """Compare one replica's row with its container; record a crash when the engine died."""
    if replica.state == ReplicaState.READY:
        health = None
        if container is not None and container.status == "running" and replica.base_url:
            health = engine.probe_health(replica.base_url)
        observed = runtime.replica_state_for(container.status if container else None, health)
        if observed in (ReplicaState.CRASHED, runtime.MISSING):
            code = runtime.exit_code(container) if container is not None else None
            tail = runtime.logs_tail(container, conf.get("TOLLGATE_LOG_TAIL_LINES")) if container else ""
            reason = (f"engine exited with code {code}" if code is not None else
                      "engine /health answered 503" if health and health >= 500 else
                      "engine container disappeared")
            lifecycle.record_crash(replica, reason, code, tail)
            done["crashed"] += 1
        elif observed == ReplicaState.LOADING:
            # Running but not answering: keep it out of routing until it answers again.
            _set_health(replica, False)
        else:
            _set_health(replica, True)
            _forgive(replica)
    elif replica.state in IN_FLIGHT and _stale(replica) and not _operation_running(replica):
        # A worker died mid-start: nobody will finish this start, so count it as a crash.
        lifecycle.record_crash(replica, f"start abandoned in state {replica.state}", None, "")
        done["crashed"] += 1


def _set_health(replica: Replica, healthy: bool) -> None:
    updated = Replica.objects.filter(pk=replica.pk, state=ReplicaState.READY).exclude(
        healthy=healthy
    ).update(healthy=healthy)
    Replica.objects.filter(pk=replica.pk).update(last_health_at=timezone.now())
    if updated:
        publish_change("replica", replica.pk)


def _forgive(replica: Replica) -> None:
    # A replica that stayed up long enough has its earlier crashes forgiven.
    if replica.crash_count and replica.ready_at and replica.ready_at < timezone.now() - timedelta(
        seconds=conf.get("TOLLGATE_CRASH_RESET_SECONDS")
    ):
        Replica.objects.filter(pk=replica.pk).update(crash_count=0)


def _stale(replica: Replica) -> bool:
    limit = conf.get("TOLLGATE_ENGINE_READY_TIMEOUT") + 120
    return replica.updated_at < timezone.now() - timedelta(seconds=limit)


def _operation_running(replica: Replica) -> bool:
    return _operation_running_for(replica.deployment)


def _converge(deployment: Deployment, done: dict[str, int]) -> None:
    """Queue what brings the deployment to its desired state (restarts, starts, stops)."""
    deployment.refresh_from_db()
    if _operation_running_for(deployment):
        return
    if deployment.desired_state == DesiredState.STOPPED:
        live = deployment.replica_set.exclude(state=ReplicaState.STOPPED)
        if live.exists() and deployment.state != DeploymentState.STOPPING:
            lifecycle.queue_operation(OperationKind.STOP, deployment)
            done["stops"] += 1
        return
    if deployment.state == DeploymentState.FAILED:
        return
    now = timezone.now()
    due = deployment.replica_set.filter(
        Q(next_restart_at__isnull=True) | Q(next_restart_at__lte=now),
        state__in=[ReplicaState.CRASHED, ReplicaState.FAILED], index__lt=deployment.replicas,
    )
    restarted = 0
    for replica in due:
        # Claim the restart: only one reconcile pass may queue it.
        claimed = Replica.objects.filter(pk=replica.pk, state=replica.state).update(
            state=ReplicaState.PENDING
        )
        if claimed:
            lifecycle.queue_operation(OperationKind.RESTART, deployment, replica=replica.index)
            restarted += 1
    done["restarts"] += restarted
    if restarted:
        return
    present = set(deployment.replica_set.values_list("index", flat=True))
    missing = [i for i in range(deployment.replicas) if i not in present]
    pending = deployment.replica_set.filter(state__in=[ReplicaState.PENDING, ReplicaState.STOPPED],
                                            index__lt=deployment.replicas)
    extra = deployment.replica_set.filter(index__gte=deployment.replicas)
    if missing or pending.exists() or extra.exists():
        lifecycle.queue_operation(OperationKind.DEPLOY, deployment)
        done["starts"] += 1
    else:
        lifecycle.refresh_deployment_state(deployment)


def _operation_running_for(deployment: Deployment) -> bool:
    # An operation no worker picked up within the start timeout no longer blocks reconcile.
    since = timezone.now() - timedelta(seconds=conf.get("TOLLGATE_ENGINE_READY_TIMEOUT") + 120)
    return deployment.operations.filter(
        status__in=[OperationStatus.QUEUED, OperationStatus.RUNNING], created_at__gte=since
    ).exists()
