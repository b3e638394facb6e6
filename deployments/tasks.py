"""Celery tasks of the deployments app: thin wrappers that take ids and call services.

Lifecycle tasks run on the queue of the node they act on (``Node.queue``), so Docker is
always driven by the worker on that box; fleet-wide passes run on the default queue.
"""

from celery import shared_task

from core.keyspace import rkey
from core.redis import get_redis
from deployments import conf, fleet, lifecycle, reconcile, staging  # noqa: F401 - registers STAGE
from deployments.choices import NodeStatus, OperationKind
from deployments.models import Node


@shared_task(name="deployments.deploy")
def deploy(operation_id: int) -> None:
    lifecycle.run_operation(operation_id, OperationKind.DEPLOY)


@shared_task(name="deployments.scale")
def scale(operation_id: int) -> None:
    lifecycle.run_operation(operation_id, OperationKind.SCALE)


@shared_task(name="deployments.stop")
def stop(operation_id: int) -> None:
    lifecycle.run_operation(operation_id, OperationKind.STOP)


@shared_task(name="deployments.restart")
def restart(operation_id: int) -> None:
    lifecycle.run_operation(operation_id, OperationKind.RESTART)


@shared_task(name="deployments.remove")
def remove(operation_id: int) -> None:
    lifecycle.run_operation(operation_id, OperationKind.REMOVE)


@shared_task(name="deployments.stage_weights")
def stage_weights(operation_id: int) -> None:
    lifecycle.run_operation(operation_id, OperationKind.STAGE)


@shared_task(name="deployments.start_ray_worker")
def start_ray_worker(operation_id: int) -> None:
    lifecycle.run_operation(operation_id, OperationKind.WORKER_START)


@shared_task(name="deployments.stop_ray_worker")
def stop_ray_worker(operation_id: int) -> None:
    lifecycle.run_operation(operation_id, OperationKind.WORKER_STOP)


TASK_FOR_KIND = {
    OperationKind.DEPLOY: deploy,
    OperationKind.SCALE: scale,
    OperationKind.STOP: stop,
    OperationKind.RESTART: restart,
    OperationKind.REMOVE: remove,
    OperationKind.STAGE: stage_weights,
    OperationKind.WORKER_START: start_ray_worker,
    OperationKind.WORKER_STOP: stop_ray_worker,
}


@shared_task(name="deployments.reconcile_node", ignore_result=True)
def reconcile_node(node_id: int) -> None:
    """One reconcile pass on this node; overlapping passes skip (Redis lock)."""
    lock = get_redis().lock(rkey("reconcile", node_id), timeout=120, blocking=False)
    if not lock.acquire():
        return
    try:
        node = Node.objects.filter(pk=node_id).first()
        if node is not None and node.status != NodeStatus.DISABLED:
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
    interval = conf.get("TOLLGATE_RECONCILE_SECONDS")
    for node in Node.objects.exclude(status=NodeStatus.DISABLED):
        # Expire rather than pile up on the queue of a node whose worker is down.
        reconcile_node.apply_async(args=[node.pk], queue=node.queue, expires=interval * 3)
        node_heartbeat.apply_async(args=[node.pk], queue=node.queue, expires=interval * 3)
    fleet.mark_silent_nodes()
    reconcile.place_all()
    fleet.check_externals()


@shared_task(name="deployments.scrape_engines", ignore_result=True)
def scrape_engines() -> None:
    fleet.scrape_all()
