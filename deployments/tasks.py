"""Celery tasks of the deployments app: thin wrappers that take ids and call services.

Lifecycle tasks run on the queue of the node they act on (``Node.queue``): the worker on
that box, or for a joined node the control plane's worker, which reaches the node's Docker
through its agent (deployments/relay.py); fleet-wide passes run on the default queue.
"""

from celery import shared_task
from django.conf import settings

from core.keyspace import rkey
from core.redis import get_redis
from deployments import (
    adapter_loading,
    adapters,
    cluster,
    credentials,
    demand,
    fleet,
    lifecycle,
    operations,
    reconcile,
    staging,
)
from deployments.choices import NodeStatus, OperationKind
from deployments.models import Node
from deployments.operations import TASKS

# One task per kind of operation; services queue them by name (operations.TASKS).


@shared_task(name=TASKS[OperationKind.DEPLOY])
def deploy(operation_id: int) -> None:
    operations.run_operation(operation_id, OperationKind.DEPLOY, lifecycle.deploy)


@shared_task(name=TASKS[OperationKind.SCALE])
def scale(operation_id: int) -> None:
    operations.run_operation(operation_id, OperationKind.SCALE, lifecycle.scale)


@shared_task(name=TASKS[OperationKind.STOP])
def stop(operation_id: int) -> None:
    operations.run_operation(operation_id, OperationKind.STOP, lifecycle.stop)


@shared_task(name=TASKS[OperationKind.RESTART])
def restart(operation_id: int) -> None:
    operations.run_operation(operation_id, OperationKind.RESTART, lifecycle.restart)


@shared_task(name=TASKS[OperationKind.REMOVE])
def remove(operation_id: int) -> None:
    operations.run_operation(operation_id, OperationKind.REMOVE, lifecycle.remove)


@shared_task(name=TASKS[OperationKind.WAKE])
def wake(operation_id: int) -> None:
    operations.run_operation(operation_id, OperationKind.WAKE, demand.wake)


@shared_task(name=demand.START_TASK)
def wake_deployment(deployment_id: int) -> None:
    """A request waits for this on-demand deployment (queued by the gateway)."""
    demand.request_start(deployment_id)


@shared_task(name="deployments.sleep_idle", ignore_result=True)
def sleep_idle() -> None:
    demand.sleep_idle()


@shared_task(name=TASKS[OperationKind.STAGE])
def stage_weights(operation_id: int) -> None:
    operations.run_operation(operation_id, OperationKind.STAGE, staging.stage)


@shared_task(name=TASKS[OperationKind.CHECK_ADAPTER])
def check_adapter(operation_id: int) -> None:
    operations.run_operation(operation_id, OperationKind.CHECK_ADAPTER, adapters.check_adapter)


@shared_task(name="deployments.unload_adapter")
def unload_adapter(base_id: int, adapter_id: int) -> None:
    """Take an adapter out of every engine holding it (it was deleted or its files changed)."""
    adapter_loading.unload_everywhere(base_id, adapter_id)


@shared_task(name="deployments.load_adapter")
def load_adapter(adapter_id: int, replica_id: int) -> None:
    """Load an adapter into a replica (a gateway asked: a request for it waits)."""
    adapter_loading.load_by_ids(adapter_id, replica_id)


@shared_task(name=TASKS[OperationKind.WORKER_START])
def start_ray_worker(operation_id: int) -> None:
    operations.run_operation(operation_id, OperationKind.WORKER_START, cluster.start_worker)


@shared_task(name=TASKS[OperationKind.WORKER_STOP])
def stop_ray_worker(operation_id: int) -> None:
    operations.run_operation(operation_id, OperationKind.WORKER_STOP, cluster.stop_worker)


@shared_task(name="deployments.reconcile_node", ignore_result=True)
def reconcile_node(node_id: int) -> None:
    """One reconcile pass on this node; overlapping passes skip (Redis lock)."""
    lock = get_redis().lock(rkey("reconcile", node_id), timeout=120, blocking=False)
    if not lock.acquire():
        return
    try:
        node = Node.objects.filter(pk=node_id).first()
        if node is not None and node.status not in (NodeStatus.DISABLED, NodeStatus.REVOKED):
            reconcile.reconcile_node(node)
            fleet.publish_log_tails(node)
    finally:
        lock.release()


@shared_task(name="deployments.node_heartbeat", ignore_result=True)
def node_heartbeat(node_id: int) -> None:
    node = Node.objects.filter(pk=node_id).first()
    if node is not None:
        fleet.heartbeat(node)


@shared_task(name="deployments.reconcile_all", ignore_result=True)
def reconcile_all() -> None:
    """Fan out: each node's reconcile and heartbeat on its own queue; externals here."""
    interval = settings.TOLLGATE_RECONCILE_SECONDS
    credentials.sync_acl_users()
    for node in Node.objects.exclude(status__in=[NodeStatus.DISABLED, NodeStatus.REVOKED]):
        # Expire rather than pile up on the queue of a node whose worker is down.
        reconcile_node.apply_async(args=[node.pk], queue=node.queue, expires=interval * 3)
        node_heartbeat.apply_async(args=[node.pk], queue=node.queue, expires=interval * 3)
    fleet.mark_silent_nodes()
    operations.resend_unclaimed()
    reconcile.place_all()
    fleet.check_externals()


@shared_task(name="deployments.scrape_engines", ignore_result=True)
def scrape_engines() -> None:
    fleet.scrape_all()
