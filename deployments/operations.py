"""Operation bookkeeping: the row each long action is, its task, its claim, lease and end.

Services create an operation and queue its task (by name, on the node's own queue, after
the transaction commits); the task's worker claims it (compare-and-set, so a task
delivered twice runs once), keeps a Redis lease alive while it works, and finishes the row
with the outcome. What an operation *does* lives in lifecycle, cluster and staging; this
module only imports the models, so every one of them can use it.
"""

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import httpx
import redis
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from kombu.exceptions import OperationalError

from core.keyspace import rkey
from core.redis import get_redis
from core.tasks import enqueue
from deployments.choices import OperationKind, OperationStatus
from deployments.models import Deployment, Node, Operation
from deployments.runtime import RuntimeFailure
from tenants.audit import Actor

log = logging.getLogger(__name__)

# The Celery task that runs each kind of operation (registered in deployments/tasks.py).
TASKS: dict[str, str] = {
    OperationKind.DEPLOY: "deployments.deploy",
    OperationKind.SCALE: "deployments.scale",
    OperationKind.STOP: "deployments.stop",
    OperationKind.RESTART: "deployments.restart",
    OperationKind.REMOVE: "deployments.remove",
    OperationKind.STAGE: "deployments.stage_weights",
    OperationKind.CHECK_ADAPTER: "deployments.check_adapter",
    OperationKind.WORKER_START: "deployments.start_ray_worker",
    OperationKind.WORKER_STOP: "deployments.stop_ray_worker",
    OperationKind.WAKE: "deployments.wake",
}
CONTROL_QUEUE = "control"


class EngineFailed(Exception):
    """An engine died or never became ready; carries its exit code and log tail."""

    def __init__(self, message: str, exit_code: int | None = None, log_tail: str = "") -> None:
        super().__init__(message)
        self.exit_code, self.log_tail = exit_code, log_tail


# Failures an operation reports in its row; anything else is also logged as a bug.
EXPECTED_FAILURES = (EngineFailed, RuntimeFailure, httpx.HTTPError)


def queue_operation(
    kind: str,
    deployment: Deployment | None,
    actor: Actor = None,
    node: Node | None = None,
    model: Any = None,
    adapter: Any = None,
    **detail: Any,
) -> Operation:
    """Record an operation and queue its task on the node's queue once this commits."""
    user = actor if actor is not None and getattr(actor, "is_authenticated", False) else None
    node = node or (deployment.node if deployment else None)
    op = Operation.objects.create(
        kind=kind,
        deployment=deployment,
        node=node,
        model=model,
        adapter=adapter,
        requested_by=user,
        detail=detail,
    )
    transaction.on_commit(lambda: send(op))
    return op


def send(op: Operation) -> None:
    """Queue the operation's task on its node's queue (the control queue without one;
    ``queue_operation`` recorded the deployment's node when none was given). The row is
    already committed: if the broker cannot take the message now (Redis restarting),
    reconcile sends it again (``resend_unclaimed``)."""
    try:
        enqueue(TASKS[op.kind], op.pk, queue=op.node.queue if op.node else CONTROL_QUEUE)
    except (OperationalError, redis.RedisError) as exc:
        log.warning("operation %s: its task could not be queued (%s); reconcile sends it again",
                    op.pk, exc)  # fmt: skip


def resend_unclaimed() -> int:
    """Send again the task of each operation no worker has claimed within
    ``TOLLGATE_OPERATION_PICKUP_SECONDS`` (its message lost: the broker restarted, or was
    down when the operation was queued); returns how many were sent. Extra deliveries are
    harmless: the first claims the row, the others find it taken. One no worker took within
    the start timeout (``TOLLGATE_ENGINE_READY_TIMEOUT`` + 120 s) fails, saying so."""
    now = timezone.now()
    pickup = settings.TOLLGATE_OPERATION_PICKUP_SECONDS
    give_up = now - timedelta(seconds=settings.TOLLGATE_ENGINE_READY_TIMEOUT + 120)
    waiting = Operation.objects.filter(
        status=OperationStatus.QUEUED, created_at__lt=now - timedelta(seconds=pickup)
    ).select_related("node")
    sent = 0
    for op in waiting:
        if op.created_at < give_up:
            _never_picked_up(op)
        elif get_redis().set(rkey("op", op.pk, "resent"), b"1", nx=True, px=int(pickup * 1000)):
            log.warning("operation %s (%s) not picked up in %.0f s: sending it again",
                        op.pk, op.kind, (now - op.created_at).total_seconds())  # fmt: skip
            send(op)
            sent += 1
    return sent


def _never_picked_up(op: Operation) -> None:
    waited = (timezone.now() - op.created_at).total_seconds()
    Operation.objects.filter(pk=op.pk, status=OperationStatus.QUEUED).update(
        status=OperationStatus.FAILED,
        finished_at=timezone.now(),
        error=f"No worker picked this operation up in {waited / 60:.0f} minutes; "
        "is the node's worker running?",
    )


def op_node(op: Operation) -> Node:
    """The node an operation acts on (its own, else the deployment's pinned node)."""
    return op.node or op.deployment.node


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
    return Operation.objects.select_related(
        "deployment__model", "deployment__node", "deployment__profile", "node", "model"
    ).get(pk=op_id)


def finish(op: Operation, error: str = "") -> None:
    """Mark the operation succeeded, or failed with ``error``."""
    status = OperationStatus.FAILED if error else OperationStatus.SUCCEEDED
    fields: dict[str, Any] = {
        "status": status,
        "error": error[:20000],
        "finished_at": timezone.now(),
    }
    if not error:
        fields["progress"] = 100.0
    update_op(op, **fields)


def lease_key(op_id: int) -> str:
    return rkey("op", op_id, "lease")


class OperationLease:
    """While an operation runs, a thread keeps its Redis lease alive. A worker killed
    mid-operation stops renewing; reconcile sees the lease lapse and takes over."""

    def __init__(self, op_id: int) -> None:
        self.key, self.ttl = lease_key(op_id), settings.TOLLGATE_OPERATION_LEASE_SECONDS
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


def run_operation(op_id: int, kind: str, handler: Callable[[Operation], None]) -> None:
    """Claim one queued operation and run ``handler`` on it under a lease; the outcome
    (and any failure's log tail) ends up in the operation row."""
    op = claim(op_id, kind)
    if op is None:
        return
    with OperationLease(op.pk):
        _run(op, handler)


def _run(op: Operation, handler: Callable[[Operation], None]) -> None:
    try:
        handler(op)
    except EXPECTED_FAILURES as exc:
        tail = getattr(exc, "log_tail", "")
        finish(op, f"{exc}\n--- last log lines ---\n{tail}" if tail else str(exc))
    except Exception as exc:
        log.exception("operation %s failed", op.pk)
        finish(op, f"unexpected error: {exc}")
        raise
    else:
        finish(op)
