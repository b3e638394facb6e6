"""Models on demand: started by the first request, stopped once idle, within each node's
memory budget.

An on-demand deployment (``Deployment.mode``) with nothing running is still a model tenants
may call. A request for it makes the gateway ask once (``core.keyspace.demand_wake_key``)
for ``deployments.wake_deployment`` on the demand queue; ``request_start`` then decides, one
decision per node at a time (a Redis lock), whether the node's budget holds it:

- the budget is what the node gives engines (``placement.capacity``, its memory limit
  when set) minus what always-running deployments there need and what other awake
  on-demand deployments need;
- when that is not enough, the least recently used idle on-demand deployments of the node
  are put to sleep until it is (always-running ones never are); when even all of them
  would not make room, the start is refused: nothing starts, and the waiting requests
  are told why (``core.keyspace.demand_failed_key``).

The decision marks the deployment awake and queues a WAKE operation on the node's queue,
which stops the evicted deployments' engines, waits until no evicted engine on the node
still holds memory, then starts the replica as a deploy does. An idle pass (beat) puts to
sleep what was not used for its idle timeout; the gateway records every use
(``core.keyspace.demand_used_key``), and keeps touching deployments with requests in flight.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet
from redis.exceptions import LockError

from core.changes import publish_change
from core.keyspace import (
    demand_failed_key,
    demand_node_lock,
    demand_stats_key,
    demand_used_key,
    demand_wake_key,
)
from core.redis import get_redis
from deployments import lifecycle, placement, planner
from deployments.choices import (
    DeploymentMode,
    DeploymentState,
    DesiredState,
    OperationKind,
    OperationStatus,
    ReplicaState,
)
from deployments.models import Deployment, Node, Operation, Replica
from deployments.operations import EngineFailed, op_node, queue_operation, update_op
from deployments.runtime import RuntimeFailure

log = logging.getLogger(__name__)

START_TASK = "deployments.wake_deployment"
FAILURE_SECONDS = 30  # how long waiting requests can read why a start failed
LOCK_SECONDS = 60  # the longest one node's decision may take
LIVE = [s for s in ReplicaState.values if s != ReplicaState.STOPPED]


class Refused(Exception):
    """No node can hold the deployment now, even after putting idle ones to sleep."""


# --- The budget -----------------------------------------------------------------------------


def need_bytes(deployment: Deployment, node: Node) -> int:
    """What the deployment's replicas hold on ``node`` once started."""
    return placement.rank_bytes(deployment, node) * deployment.replicas


def on_node(node: Node) -> QuerySet[Deployment]:
    """Deployments wanted running whose engines run (or would run) on ``node``."""
    placed = Replica.objects.filter(node=node).values("deployment_id")
    return (
        Deployment.objects.filter(Q(node=node) | Q(pk__in=placed))
        .filter(desired_state=DesiredState.RUNNING, external=False)
        .select_related("model", "profile", "node")
        .distinct()
    )


@dataclass(frozen=True)
class Budget:
    """A node's memory for engines: what it gives, what always-running and awake on-demand
    deployments need, and what is left (bytes)."""

    usable: int
    always: int
    on_demand: int
    explanation: str

    @property
    def free(self) -> int:
        return self.usable - self.always - self.on_demand


def budget(node: Node, leave_out: Deployment | None = None) -> Budget:
    """The node's budget, not counting ``leave_out`` (the deployment being decided)."""
    always = on_demand = held = 0
    for deployment in on_node(node):
        if leave_out is not None and deployment.pk == leave_out.pk:
            continue
        need = need_bytes(deployment, node)
        if deployment.on_demand:
            on_demand += need if deployment.awake else 0
        else:
            always += need
        live = deployment.replica_set.filter(node=node, state__in=LIVE).count()
        held += placement.rank_bytes(deployment, node) * live
    cap = placement.capacity(node, held)
    return Budget(cap.usable, always, on_demand, cap.explanation)


def node_budget(node: Node) -> dict[str, int]:
    """The node's budget for the console and the API (bytes)."""
    b = budget(node)
    return {
        "usable_bytes": b.usable,
        "always_bytes": b.always,
        "on_demand_bytes": b.on_demand,
        "free_bytes": b.free,
    }


def demand_state(deployment: Deployment) -> str:
    """loaded, loading or unloaded for an on-demand deployment; "" for others."""
    if not deployment.on_demand:
        return ""
    if not deployment.awake or deployment.desired_state != DesiredState.RUNNING:
        return "unloaded"
    ready = deployment.replica_set.filter(state=ReplicaState.READY).exists()
    return "loaded" if ready else "loading"


def last_used(deployment_ids: list[int]) -> dict[int, float]:
    """When the gateway last saw each deployment used (epoch seconds; absent: never)."""
    if not deployment_ids:
        return {}
    scores = get_redis().zmscore(demand_used_key(), [str(i) for i in deployment_ids])
    return {i: s for i, s in zip(deployment_ids, scores, strict=True) if s is not None}


# --- Deciding a start (the control plane's worker, on the demand queue) ----------------------


def request_start(deployment_id: int) -> None:
    """The task's body: wake the deployment if a node can hold it, else say why."""
    deployment = (
        Deployment.objects.select_related("model", "profile", "node")
        .filter(pk=deployment_id)
        .first()
    )
    if deployment is None or not deployment.on_demand:
        get_redis().delete(demand_wake_key(deployment_id))
        return
    if deployment.desired_state != DesiredState.RUNNING:
        _refuse(deployment, f"The model {deployment.model} is stopped by an admin.")
        return
    if deployment.awake:
        # Already starting or started (a request that asked again after its wait): the
        # WAKE operation under way, or the ready replica, answers it.
        if not _starting(deployment):
            _ensure_running(deployment)
        return
    try:
        node = _decide(deployment)
    except Refused as exc:
        _refuse(deployment, str(exc))
        return
    log.info("waking %s on %s", deployment, node)


def _decide(deployment: Deployment) -> Node:
    """Choose the node, evict what must go and mark the deployment awake (raises Refused)."""
    nodes = [deployment.node] if deployment.node_id else placement.candidates()
    if not nodes:
        raise Refused(f"No node is online to start {deployment.model} on.")
    reasons = []
    for node in _by_free_memory(deployment, nodes):
        try:
            with get_redis().lock(
                demand_node_lock(node.pk), timeout=LOCK_SECONDS, blocking_timeout=LOCK_SECONDS
            ):
                victims = _make_room(deployment, node)
                _wake_on(deployment, node, victims)
                return node
        except Refused as exc:
            reasons.append(str(exc))
        except LockError:
            reasons.append(f"{node.name}: another start did not finish its decision in time")
    raise Refused(" ".join(reasons))


def _by_free_memory(deployment: Deployment, nodes: list[Node]) -> list[Node]:
    return sorted(nodes, key=lambda n: budget(n, leave_out=deployment).free, reverse=True)


def _make_room(deployment: Deployment, node: Node) -> list[Deployment]:
    """The idle on-demand deployments to put to sleep so ``deployment`` fits (least recently
    used first); raises Refused when even all of them would not make room."""
    need = need_bytes(deployment, node)
    room = budget(node, leave_out=deployment)
    if not room.usable:
        raise Refused(f"{node.name}: its memory is unknown (no report from its worker yet).")
    if need > room.usable - room.always:
        raise Refused(
            f"{deployment.model} needs {planner.gb(need)}; {node.name} gives engines "
            f"{planner.gb(room.usable)} ({room.explanation}), of which always-running "
            f"deployments need {planner.gb(room.always)}: it can never fit there."
        )
    free, victims, busy = room.free, [], 0
    for other in _evictable(node, deployment):
        if free >= need:
            break
        used = last_used([other.pk]).get(other.pk, 0.0)
        if time.time() - used < settings.TOLLGATE_DEMAND_BUSY_SECONDS:
            busy += need_bytes(other, node)
            continue
        victims.append(other)
        free += need_bytes(other, node)
    if free < need:
        raise Refused(
            f"{deployment.model} needs {planner.gb(need)} on {node.name}, which has "
            f"{planner.gb(max(free, 0))} free; on-demand models in use there hold "
            f"{planner.gb(busy)}. Retry once one of them is idle."
        )
    return victims


def _evictable(node: Node, deployment: Deployment) -> list[Deployment]:
    """Awake on-demand deployments on the node, least recently used first."""
    awake = [d for d in on_node(node) if d.on_demand and d.awake and d.pk != deployment.pk]
    used = last_used([d.pk for d in awake])
    return sorted(awake, key=lambda d: used.get(d.pk, 0.0))


@transaction.atomic
def _wake_on(deployment: Deployment, node: Node, victims: list[Deployment]) -> None:
    """Record the decision: victims asleep, the deployment awake on ``node``, its start queued."""
    evicted = []
    for victim in victims:
        if Deployment.objects.filter(pk=victim.pk, awake=True).update(awake=False):
            evicted.append(victim.pk)
            _count("evictions", victim.model.served_name)
            log.info("evicting %s from %s to start %s", victim, node, deployment)
    Deployment.objects.filter(pk=deployment.pk).update(
        awake=True, state=DeploymentState.PENDING, state_message=""
    )
    _pin_replicas(deployment, node)
    get_redis().zadd(demand_used_key(), {str(deployment.pk): time.time()})
    queue_operation(OperationKind.WAKE, deployment, node=node, evict=evicted, asked=time.time())
    for pk in [deployment.pk, *evicted]:
        transaction.on_commit(lambda pk=pk: publish_change("deployment", pk))


def _pin_replicas(deployment: Deployment, node: Node) -> None:
    """An unpinned deployment's replicas start on the chosen node (idle rows move there)."""
    for index in range(deployment.replicas):
        replica, _ = Replica.objects.get_or_create(
            deployment=deployment, index=index, defaults={"node": node}
        )
        if replica.node_id != node.pk:
            Replica.objects.filter(pk=replica.pk, state__in=lifecycle.STARTABLE).update(node=node)


def _starting(deployment: Deployment) -> bool:
    return deployment.operations.filter(
        kind=OperationKind.WAKE, status__in=[OperationStatus.QUEUED, OperationStatus.RUNNING]
    ).exists()


def _ensure_running(deployment: Deployment) -> None:
    """Awake, no start under way: a ready replica answers (the gateway only had a stale
    view), else start it again on its node."""
    if deployment.replica_set.filter(state=ReplicaState.READY, healthy=True).exists():
        get_redis().delete(demand_wake_key(deployment.pk))
        publish_change("deployment", deployment.pk)
        return
    node = deployment.node or Node.objects.filter(replicas__deployment=deployment).first()
    if node is None:
        Deployment.objects.filter(pk=deployment.pk).update(awake=False)
        request_start(deployment.pk)
        return
    queue_operation(OperationKind.WAKE, deployment, node=node, evict=[], asked=time.time())


def _refuse(deployment: Deployment, reason: str) -> None:
    log.warning("not starting %s: %s", deployment, reason)
    r = get_redis()
    r.set(demand_failed_key(deployment.pk), reason[:2000], ex=FAILURE_SECONDS)
    r.delete(demand_wake_key(deployment.pk))
    Deployment.objects.filter(pk=deployment.pk).update(state_message=reason[:2000])
    publish_change("deployment", deployment.pk)


# --- Starting (the node's worker: a WAKE operation) ------------------------------------------


def wake(op: Operation) -> None:
    """Stop what was evicted for this start, then start the deployment's replicas on this
    node as a deploy does (which first waits until the node holds no evicted engine)."""
    deployment, node = op.deployment, op_node(op)
    try:
        for victim in Deployment.objects.filter(pk__in=op.detail.get("evict", [])):
            put_to_sleep_here(victim, node, op)
        deployment.refresh_from_db()
        if not deployment.awake:
            update_op(op, message="put to sleep again before it started")
            return
        update_op(op, phase="start", message=f"starting {deployment} on {node.name}")
        lifecycle.deploy(op)  # once no evicted engine on the node holds memory
        if not deployment.replica_set.filter(state=ReplicaState.READY).exists():
            raise EngineFailed(f"{deployment} has no ready replica after its start")
    except (EngineFailed, RuntimeFailure) as exc:
        # Asleep again, so reconcile does not retry it: the next request asks afresh.
        Deployment.objects.filter(pk=deployment.pk).update(awake=False)
        get_redis().set(demand_failed_key(deployment.pk), str(exc)[:2000], ex=FAILURE_SECONDS)
        raise
    else:
        waited = time.time() - float(op.detail.get("asked") or time.time())
        _count("starts", deployment.model.served_name, waited)
    finally:
        get_redis().delete(demand_wake_key(deployment.pk))
        publish_change("deployment", deployment.pk)


def put_to_sleep_here(deployment: Deployment, node: Node, op: Operation | None) -> None:
    """Drain and remove the deployment's engines on ``node`` (it is asleep)."""
    for replica in lifecycle.on_node(deployment, node).filter(state__in=LIVE):
        lifecycle.drain_and_remove(replica, op)
    mark_asleep(deployment)


def mark_asleep(deployment: Deployment) -> None:
    """Stopped once no engine of the (still asleep) deployment is left."""
    lifecycle.mark_stopped_when_done(deployment)
    publish_change("deployment", deployment.pk)


# --- Idle pass (beat, on the control queue) ---------------------------------------------------


def sleep_idle() -> int:
    """Put to sleep the awake on-demand deployments unused for their idle timeout (and copy
    the gateway's last-use times into the rows the console shows); how many slept."""
    rows = list(Deployment.objects.filter(mode=DeploymentMode.ON_DEMAND).select_related("node"))
    used = last_used([d.pk for d in rows])
    now, slept = time.time(), 0
    for deployment in rows:
        last = used.get(deployment.pk)
        if last is not None:
            _record_last_use(deployment, last)
        if not deployment.awake or _starting(deployment):
            continue
        seen = last or (deployment.updated_at.timestamp() if deployment.updated_at else now)
        if now - seen < deployment.idle_timeout_seconds:
            continue
        if Deployment.objects.filter(pk=deployment.pk, awake=True).update(awake=False):
            log.info("%s idle for %.0f s: putting it to sleep", deployment, now - seen)
            _stop_everywhere(deployment)
            slept += 1
    return slept


def _record_last_use(deployment: Deployment, when: float) -> None:
    stamp = datetime.fromtimestamp(when, tz=UTC)
    if deployment.last_used_at is None or abs(deployment.last_used_at.timestamp() - when) >= 1:
        Deployment.objects.filter(pk=deployment.pk).update(last_used_at=stamp)


def _stop_everywhere(deployment: Deployment) -> None:
    """Queue a stop on each node holding an engine of the (now asleep) deployment."""
    nodes = Node.objects.filter(
        replicas__deployment=deployment, replicas__state__in=LIVE
    ).distinct()
    queued = False
    for node in nodes:
        queue_operation(OperationKind.STOP, deployment, node=node)
        queued = True
    if not queued:
        mark_asleep(deployment)


# --- Counters (read by the gateway's /metrics) -------------------------------------------------


def _count(kind: str, model: str, seconds: float | None = None) -> None:
    """Evictions and starts per model, and the starts' time to ready, kept in Redis."""
    pipe = get_redis().pipeline(transaction=False)
    pipe.hincrby(demand_stats_key(), f"{kind}:{model}", 1)
    if seconds is not None:
        pipe.hincrbyfloat(demand_stats_key(), f"ready_seconds:{model}", round(seconds, 3))
    pipe.execute()
