"""Where replicas run: the deployment's pinned node, or the node with the most free memory.

Each replica row names its node (and, for two-box tensor parallelism, its Ray worker's
node). Placement fills those in for replicas that have none or whose node is no longer
online, using the memory-fit arithmetic of ``planner``; the lifecycle then queues each
node's share of the work on that node's own queue.
"""

import logging
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from deployments import planner
from deployments.choices import DesiredState, NodeStatus, ReplicaState
from deployments.models import Deployment, Node, Replica

log = logging.getLogger(__name__)
# Replicas in these states hold no memory on their node.
IDLE = [ReplicaState.STOPPED, ReplicaState.CRASHED, ReplicaState.FAILED, ReplicaState.PENDING]


class NoRoom(Exception):
    """No online node can take a replica; the message carries the sums."""


# --- Tensor parallelism over nodes ------------------------------------------------------------


def tensor_parallel_size(deployment: Deployment) -> int:
    return int(deployment.effective_args.get("tensor-parallel-size") or 1)


def spans_nodes(deployment: Deployment) -> bool:
    """True when one replica needs more GPUs than one node has: a Ray group over two nodes.

    An unpinned deployment is planned for one-GPU nodes (DGX Spark).
    """
    gpus = deployment.node.gpu_count if deployment.node_id and deployment.node else 1
    return tensor_parallel_size(deployment) > max(gpus, 1)


def nodes_per_replica(deployment: Deployment) -> int:
    return 2 if spans_nodes(deployment) else 1


# --- Memory ---------------------------------------------------------------------------------


def pool_bytes(node: Node) -> int:
    if node.gpu_memory_bytes and not node.unified_memory:
        return node.gpu_memory_bytes
    return node.total_memory_bytes if node.unified_memory or node.gpu_count else 0


def rank_bytes(deployment: Deployment, node: Node) -> int:
    """What one replica (one node's share of a tensor-parallel replica) holds on ``node``."""
    args, model = deployment.effective_args, deployment.model
    share = nodes_per_replica(deployment)
    active = model.active_params_billions
    return planner.footprint(
        float(model.params_billions) / share,
        model.quantization,
        int(args.get("max-model-len") or model.context_length),
        int(args.get("max-num-seqs") or planner.DEFAULT_MAX_NUM_SEQS),
        # Weights and KV heads are sharded over the ranks.
        (model.kv_bytes_per_token // share) if model.kv_bytes_per_token else None,
        str(args.get("kv-cache-dtype", "auto")),
        args.get("gpu-memory-utilization"),
        pool_bytes(node),
        float(active) / share if active is not None else None,
    ).per_replica


def _replicas_on(node: Node) -> "list[Replica]":
    return list(
        Replica.objects.filter(Q(node=node) | Q(worker_node=node))
        .filter(deployment__desired_state=DesiredState.RUNNING, deployment__external=False)
        .select_related("deployment__model", "deployment__profile", "deployment__node")
    )


def free_bytes(node: Node, exclude: Deployment | None = None) -> tuple[int, int]:
    """(usable capacity, what other deployments' replicas on the node take) in bytes."""
    assigned = held = 0
    for replica in _replicas_on(node):
        if exclude is not None and replica.deployment_id == exclude.pk:
            continue
        need = rank_bytes(replica.deployment, node)
        idle = replica.state in IDLE
        if replica.deployment.on_demand and idle and not replica.deployment.awake:
            continue  # asleep: it holds nothing, and is put to sleep again to make room
        assigned += need
        if not idle:
            held += need
    return capacity(node, held).usable, assigned


def capacity(node: Node, held: int) -> planner.Capacity:
    """The node's capacity for engines, capped by its memory limit when the admin set one."""
    cap = planner.capacity(
        node.total_memory_bytes,
        node.available_memory_bytes,
        node.gpu_memory_bytes,
        node.unified_memory,
        held,
    )
    limit = node.memory_limit_bytes
    if limit and (not cap.usable or limit < cap.usable):
        return planner.Capacity(limit, f"the node's engine memory limit {planner.gb(limit)}")
    return cap


def candidates() -> list[Node]:
    """Online nodes whose worker sent a heartbeat within the timeout."""
    since = timezone.now() - timedelta(seconds=settings.TOLLGATE_NODE_HEARTBEAT_TIMEOUT)
    return list(Node.objects.filter(status=NodeStatus.ONLINE, last_seen_at__gte=since))


def choose(deployment: Deployment, planned: dict[int, int], avoid: set[int]) -> Node:
    """The node with the most free memory that fits one more replica (rank) of ``deployment``."""
    best, best_free, refused = None, -1, []
    for node in candidates():
        if node.pk in avoid:
            continue
        usable, taken = free_bytes(node, exclude=deployment)
        need = rank_bytes(deployment, node)
        free = usable - taken - planned.get(node.pk, 0)
        if usable and free < need:
            refused.append(
                f"{node.name}: needs {planner.gb(need)}, {planner.gb(max(free, 0))} free"
            )
            continue
        if free > best_free:
            best, best_free = node, free
    if best is None:
        detail = "; ".join(refused) or "no online node"
        raise NoRoom(f"No node can take a replica of {deployment.name} ({detail}).")
    planned[best.pk] = planned.get(best.pk, 0) + rank_bytes(deployment, best)
    return best


# --- Placing replicas ---------------------------------------------------------------------------


def _usable(node: Node | None) -> bool:
    return node is not None and node.status == NodeStatus.ONLINE


def _replica(deployment: Deployment, index: int) -> Replica:
    try:
        with transaction.atomic():
            replica, _ = Replica.objects.get_or_create(deployment=deployment, index=index)
    except IntegrityError:  # another placement created it at the same moment
        replica = Replica.objects.get(deployment=deployment, index=index)
    return replica


def place(deployment: Deployment) -> list[Replica]:
    """Give every wanted replica a node (and a Ray worker node); returns the moved or new ones.

    Pinned deployments run where they are pinned. Unpinned replicas stay where they are
    while that node is online; otherwise they move to the node with the most free memory
    that fits (the old node's container is an orphan once it comes back, and is removed).
    """
    moved, group = [], spans_nodes(deployment)
    planned = _staying(deployment)
    for index in range(deployment.replicas):
        replica = _replica(deployment, index)
        old = (replica.node_id, replica.worker_node_id)
        head, worker = _target(deployment, replica, group, planned)
        if (head.pk if head else None, worker.pk if worker else None) == old:
            continue
        fields = {"node": head, "worker_node": worker}
        if old[0] is not None:
            # Moving: the replica starts afresh on its new node.
            fields.update(
                state=ReplicaState.PENDING,
                healthy=False,
                container_id="",
                container_name="",
                worker_container_name="",
                host="",
                port=None,
                ready_at=None,
                next_restart_at=None,
            )
        updated = Replica.objects.filter(
            pk=replica.pk, node_id=old[0], worker_node_id=old[1]
        ).update(**fields)
        if updated:
            replica.refresh_from_db()
            moved.append(replica)
            log.info("placed %s on %s%s", replica, head, f" + {worker}" if worker else "")
    return moved


def _staying(deployment: Deployment) -> dict[int, int]:
    """Memory the deployment's replicas that stay where they are hold per node, so a replica
    moved there counts them (free_bytes leaves the deployment itself out)."""
    planned: dict[int, int] = {}
    rows = deployment.replica_set.filter(index__lt=deployment.replicas).select_related(
        "node", "worker_node"
    )
    for replica in rows:
        for node in (replica.node, replica.worker_node):
            if _usable(node):
                planned[node.pk] = planned.get(node.pk, 0) + rank_bytes(deployment, node)
    return planned


def _target(
    deployment: Deployment, replica: Replica, group: bool, planned: dict[int, int]
) -> tuple[Node | None, Node | None]:
    if deployment.node_id:
        head = deployment.node
        if not group:
            return head, None
        if deployment.worker_node_id:
            return head, deployment.worker_node
        if replica.node_id == head.pk and _usable(replica.worker_node):
            return head, replica.worker_node
        return head, choose(deployment, planned, avoid={head.pk})
    head = replica.node if _usable(replica.node) else None
    worker = replica.worker_node if group and _usable(replica.worker_node) else None
    if head is not None and (not group or worker is not None):
        return head, worker
    # Re-place the whole group: a Ray group is started and stopped as one.
    head = choose(deployment, planned, avoid=set())
    worker = choose(deployment, planned, avoid={head.pk}) if group else None
    return head, worker


def check_placeable(deployment: Deployment) -> None:
    """Refuse (NoRoom) an unpinned deployment no set of online nodes can hold."""
    planned: dict[int, int] = {}
    for _ in range(deployment.replicas):
        head = choose(deployment, planned, avoid=set())
        if spans_nodes(deployment):
            choose(deployment, planned, avoid={head.pk})
