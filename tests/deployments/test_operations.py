"""Operation bookkeeping: each kind is queued by its task's name, on its node's queue, once
the transaction that recorded it commits (the real Celery broker, read back from Redis)."""

import uuid
from collections.abc import Iterator
from datetime import timedelta

import orjson
import pytest
import redis
from django.db import transaction
from django.utils import timezone
from kombu.exceptions import OperationalError

from config.celery import app
from deployments import operations, tasks
from deployments.choices import OperationKind, OperationStatus
from deployments.models import Node, Operation


@pytest.fixture
def node(transactional_db: None, redis_namespace: str) -> Iterator[Node]:
    node = Node.objects.create(
        name=f"n-{uuid.uuid4().hex[:8]}",
        docker_url="tcp://127.0.0.1:1",
        queue=f"node.test-{uuid.uuid4().hex[:12]}",
    )
    yield node
    broker().delete(node.queue)


def broker() -> redis.Redis:
    # The app's own broker: Celery prefers a CELERY_BROKER_URL in the environment to settings.
    return redis.Redis.from_url(app.conf.broker_url)


def test_every_operation_task_is_registered_under_the_name_services_queue() -> None:
    names = {
        task.name
        for task in (
            tasks.deploy,
            tasks.scale,
            tasks.stop,
            tasks.restart,
            tasks.remove,
            tasks.stage_weights,
            tasks.check_adapter,
            tasks.start_ray_worker,
            tasks.stop_ray_worker,
            tasks.wake,
        )
    }
    assert names == set(operations.TASKS.values())
    assert all(app.tasks[name].name == name for name in names)


def test_an_operation_is_queued_on_its_nodes_queue_after_commit(node: Node) -> None:
    with transaction.atomic():
        op = operations.queue_operation(OperationKind.STOP, None, node=node, replica_id=7)
        assert broker().llen(node.queue) == 0  # a rolled-back operation must never run
    (message,) = broker().lrange(node.queue, 0, -1)
    headers = orjson.loads(message)["headers"]
    assert (headers["task"], headers["argsrepr"]) == ("deployments.stop", f"[{op.pk}]")
    row = Operation.objects.get(pk=op.pk)
    assert (row.status, row.node, row.detail) == (OperationStatus.QUEUED, node, {"replica_id": 7})


def test_a_rolled_back_operation_is_never_queued(node: Node) -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        operations.queue_operation(OperationKind.STOP, None, node=node)
        raise RuntimeError("the service failed after recording the operation")
    assert broker().llen(node.queue) == 0 and not Operation.objects.exists()


def test_a_second_delivery_of_a_claimed_operation_does_nothing(node: Node) -> None:
    op = Operation.objects.create(kind=OperationKind.STOP, node=node)
    ran: list[int] = []
    operations.run_operation(op.pk, OperationKind.STOP, lambda claimed: ran.append(claimed.pk))
    operations.run_operation(op.pk, OperationKind.STOP, lambda claimed: ran.append(claimed.pk))
    op.refresh_from_db()
    assert ran == [op.pk] and op.status == OperationStatus.SUCCEEDED and op.progress == 100


def test_an_engine_failure_ends_in_the_row_with_its_log_tail(node: Node) -> None:
    op = Operation.objects.create(kind=OperationKind.STOP, node=node)

    def fail(claimed: Operation) -> None:
        raise operations.EngineFailed("the engine exited with code 3", 3, "CUDA out of memory")

    operations.run_operation(op.pk, OperationKind.STOP, fail)
    op.refresh_from_db()
    assert op.status == OperationStatus.FAILED and op.finished_at is not None
    assert op.error == "the engine exited with code 3\n--- last log lines ---\nCUDA out of memory"


def queued_ago(op: Operation, seconds: float) -> None:
    Operation.objects.filter(pk=op.pk).update(
        created_at=timezone.now() - timedelta(seconds=seconds)
    )


def test_a_task_the_broker_refused_is_sent_again_once_no_worker_claimed_it(
    node: Node, settings: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis restarting the moment an operation is queued: the row is saved (the caller is
    not failed), and reconcile sends its task again after the pickup time, once per pickup
    time; a claimed one is never sent again."""
    settings.TOLLGATE_OPERATION_PICKUP_SECONDS = 20.0

    def refused(*args: object, **kwargs: object) -> None:
        raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    with monkeypatch.context() as patch:
        patch.setattr(operations, "enqueue", refused)
        op = operations.queue_operation(OperationKind.STOP, None, node=node)
    assert broker().llen(node.queue) == 0
    assert Operation.objects.get(pk=op.pk).status == OperationStatus.QUEUED

    assert operations.resend_unclaimed() == 0  # queued a moment ago: a worker may take it
    queued_ago(op, 21)
    assert operations.resend_unclaimed() == 1
    (message,) = broker().lrange(node.queue, 0, -1)
    assert orjson.loads(message)["headers"]["argsrepr"] == f"[{op.pk}]"
    assert operations.resend_unclaimed() == 0  # not again within the pickup time

    other = Operation.objects.create(kind=OperationKind.STOP, node=node)
    operations.run_operation(other.pk, OperationKind.STOP, lambda claimed: None)
    queued_ago(other, 60)
    assert operations.resend_unclaimed() == 0 and broker().llen(node.queue) == 1


def test_an_operation_no_worker_took_within_the_start_timeout_fails_saying_so(
    node: Node, settings: object
) -> None:
    settings.TOLLGATE_ENGINE_READY_TIMEOUT = 600.0
    op = Operation.objects.create(kind=OperationKind.DEPLOY, node=node)
    queued_ago(op, 600 + 121)
    assert operations.resend_unclaimed() == 0 and broker().llen(node.queue) == 0
    op.refresh_from_db()
    assert op.status == OperationStatus.FAILED and op.finished_at is not None
    assert op.error == (
        "No worker picked this operation up in 12 minutes; is the node's worker running?"
    )
