"""Node heartbeats, external engines' health, and engine telemetry into Redis."""

import logging
import platform
from datetime import timedelta

import orjson
import redis
from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from core.changes import publish_change
from core.keyspace import engine_metrics_key, engine_own_key, pool_keys, rkey, usage_stream
from core.redis import get_redis
from deployments import engine, nodes, relay, runtime
from deployments.choices import (
    DeploymentState,
    DesiredState,
    NodeStatus,
    ReplicaState,
)
from deployments.models import Deployment, Node, Replica
from nodeagent.facts import available_memory_bytes, gpu_facts

log = logging.getLogger(__name__)


# --- Nodes --------------------------------------------------------------------------------


def heartbeat(node: Node) -> Node:
    """Record what the node is (arch, memory, GPUs, Docker version).

    A node with its own worker reads its /proc itself; a joined node's agent reports its
    box's figures (relay.read_facts), and its silence simply leaves ``last_seen_at`` to age."""
    box = relay.read_facts(node.name) if relay.is_relayed(node.docker_url) else None
    if relay.is_relayed(node.docker_url) and box is None:
        return node
    try:
        facts = runtime.info(runtime.client(node.docker_url))
    except runtime.RuntimeFailure as exc:
        log.warning("node %s: %s", node.name, exc)
        mark_unreachable(node, f"its Docker Engine does not answer: {exc}")
        return node
    gpus, description = (box["gpu_count"], box["gpu_description"]) if box else gpu_facts()
    available = box["available_memory_bytes"] if box else available_memory_bytes()
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(
        facts.get("Architecture", ""), nodes.local_arch()
    )
    fields = {
        "arch": arch,
        "cpu_count": facts.get("NCPU") or 0,
        "total_memory_bytes": facts.get("MemTotal") or nodes.local_memory_bytes(),
        "available_memory_bytes": available,
        "docker_version": str(facts.get("ServerVersion", ""))[:64],
        "last_seen_at": timezone.now(),
    }
    if gpus:
        fields.update(gpu_count=gpus, gpu_description=description[:200])
        # GB10 shares one pool between CPU and GPU; NVML has no memory figure for it.
        fields["unified_memory"] = node.unified_memory or "GB10" in description
    Node.objects.filter(pk=node.pk).update(**fields)
    Node.objects.filter(pk=node.pk, status=NodeStatus.UNREACHABLE).update(status=NodeStatus.ONLINE)
    node.refresh_from_db()
    log.debug("heartbeat %s on %s", node.name, platform.node())
    return node


def mark_silent_nodes() -> int:
    """Nodes whose worker sent no heartbeat within the timeout are marked unreachable."""
    timeout = settings.TOLLGATE_NODE_HEARTBEAT_TIMEOUT
    cutoff = timezone.now() - timedelta(seconds=timeout)
    count = 0
    for node in Node.objects.filter(status=NodeStatus.ONLINE, last_seen_at__lt=cutoff):
        count += mark_unreachable(node, f"no heartbeat for more than {timeout:g} s")
    return count


def mark_unreachable(node: Node, reason: str) -> int:
    """Flip a node to unreachable (once) and take its replicas out of routing at once.

    Unpinned replicas are then placed on other nodes by the next placement pass; when the
    node comes back, its reconcile removes what now runs elsewhere and re-admits the rest.
    """
    flipped = (
        Node.objects.filter(pk=node.pk)
        .exclude(status__in=[NodeStatus.DISABLED, NodeStatus.UNREACHABLE, NodeStatus.REVOKED])
        .update(status=NodeStatus.UNREACHABLE)
    )
    if not flipped:
        return 0
    log.warning("node %s is unreachable: %s", node.name, reason)
    drain_node(node, f"node {node.name} unreachable: {reason}")
    return 1


def drain_node(node: Node, reason: str) -> None:
    """Take every replica on the node out of routing at once and mark its deployments
    degraded; placement then puts unpinned replicas on other nodes."""
    affected = Replica.objects.filter(Q(node=node) | Q(worker_node=node))
    for replica in affected.filter(healthy=True):
        if Replica.objects.filter(pk=replica.pk, healthy=True).update(
            healthy=False, last_error=reason
        ):
            publish_change("replica", replica.pk)
    for deployment_id in set(affected.values_list("deployment_id", flat=True)):
        Deployment.objects.filter(pk=deployment_id, state=DeploymentState.READY).update(
            state=DeploymentState.DEGRADED, state_message=reason
        )
        publish_change("deployment", deployment_id)


# --- External engines ---------------------------------------------------------------------


def check_external(deployment: Deployment) -> Replica:
    """Health-check an engine Tollgate does not run; route it while it answers."""
    replica, _ = Replica.objects.get_or_create(
        deployment=deployment, index=0, defaults={"external_url": deployment.external_url}
    )
    if replica.external_url != deployment.external_url:
        Replica.objects.filter(pk=replica.pk).update(external_url=deployment.external_url)
        replica.external_url = deployment.external_url
    now = timezone.now()
    if deployment.desired_state != DesiredState.RUNNING:
        changed = (
            Replica.objects.filter(pk=replica.pk)
            .exclude(state=ReplicaState.STOPPED)
            .update(state=ReplicaState.STOPPED, healthy=False)
        )
        Deployment.objects.filter(pk=deployment.pk).update(state=DeploymentState.STOPPED)
    else:
        key = deployment.upstream_key
        status = engine.probe_health(deployment.external_url, key)
        served = engine.served_models(deployment.external_url, key) if status == 200 else []
        ok = deployment.model.served_name in served
        new_state = ReplicaState.READY if ok else ReplicaState.CRASHED
        error = (
            ""
            if ok
            else (
                f"/health answered {status}"
                if status not in (None, 200)
                else "not reachable"
                if status is None
                else f"/v1/models does not list {deployment.model.served_name!r} "
                f"(it lists {served})"
            )
        )
        changed = (
            Replica.objects.filter(pk=replica.pk)
            .exclude(state=new_state, healthy=ok)
            .update(state=new_state, healthy=ok, ready_at=now if ok else None, last_error=error)
        )
        Replica.objects.filter(pk=replica.pk).update(last_health_at=now)
        Deployment.objects.filter(pk=deployment.pk).update(
            state=DeploymentState.READY if ok else DeploymentState.DEGRADED,
            state_message="" if ok else f"external engine {error}",
        )
    if changed:
        publish_change("replica", replica.pk)
    replica.refresh_from_db()
    return replica


def check_externals() -> int:
    count = 0
    for deployment in Deployment.objects.filter(external=True).select_related("model"):
        check_external(deployment)
        count += 1
    return count


# --- Telemetry ----------------------------------------------------------------------------


def telemetry_key(replica_id: int) -> str:
    return engine_metrics_key(replica_id)


def scrape_replica(replica: Replica) -> dict[str, float] | None:
    """Scrape one replica's /metrics into Redis (a JSON value with a short TTL)."""
    key = replica.deployment.upstream_key if replica.deployment.external else ""
    # The usage stream's last id BEFORE the engine's counters: every event up to it was
    # settled, so counted by the engine, by the time of the scrape (metering/engine_ledger.py).
    stream_id = last_usage_id()
    figures = engine.scrape(replica.base_url, key)
    if figures is None:
        return None
    figures["scraped_at"] = timezone.now().timestamp()
    figures["deployment_id"] = replica.deployment_id
    figures["stream_id"] = stream_id
    figures["incarnation"] = incarnation(replica)
    # The gateway's slot holders for the model, read right after the engine's own count: the
    # admission controller compares the two to tell whether preempting frees an engine slot.
    with get_redis().pipeline(transaction=False) as pipe:
        pipe.zcard(pool_keys(replica.deployment.model_id)[0])
        pipe.hgetall(engine_own_key(replica.pk))
        holders, own = pipe.execute()
    figures["slot_holders"] = holders
    figures["own"] = {k.decode(): int(v) for k, v in own.items()}
    get_redis().set(
        telemetry_key(replica.pk), orjson.dumps(figures), ex=settings.TOLLGATE_TELEMETRY_TTL_SECONDS
    )
    return figures


def last_usage_id() -> str:
    """The id of the last entry ever appended to the usage stream (``0-0``: none yet)."""
    try:
        info = get_redis().xinfo_stream(usage_stream())
    except redis.ResponseError:  # no such stream yet
        return "0-0"
    last = info["last-generated-id"]
    return last.decode() if isinstance(last, bytes) else str(last)


def incarnation(replica: Replica) -> str:
    """Names one life of a replica's engine: a restart (a new container, or an external
    engine seen starting again) begins new counters."""
    started = replica.started_at.timestamp() if replica.started_at else 0
    return f"{replica.container_id or replica.external_url}@{started:.3f}"


def read_telemetry(replica_id: int) -> dict[str, float] | None:
    raw = get_redis().get(telemetry_key(replica_id))
    return orjson.loads(raw) if raw else None


def scrape_all() -> int:
    count = 0
    ready = (
        Replica.objects.filter(state=ReplicaState.READY)
        .filter(Q(deployment__external=True) | Q(port__isnull=False))
        .select_related("deployment")
    )
    for replica in ready:
        if scrape_replica(replica) is not None:
            count += 1
    return count


# --- Log tails ------------------------------------------------------------------------------

LOG_LINES = 500
LOG_TTL_SECONDS = 120


def log_key(replica_id: int) -> str:
    return rkey("engine", replica_id, "logs")


def publish_log_tails(node: Node) -> int:
    """Copy the log tail of each engine on this node into Redis for the console and API.

    Runs on the node's own worker (the only process that may talk to its Docker), so the
    web process never needs the Docker socket."""
    replicas = Replica.objects.filter(node=node).exclude(container_name="")
    if not replicas:
        return 0
    client, published = runtime.client(node.docker_url), 0
    for replica in replicas:
        try:
            container = runtime.find(client, replica.container_name)
            text = runtime.logs_tail(container, LOG_LINES) if container else ""
        except runtime.RuntimeFailure:
            continue
        get_redis().set(log_key(replica.pk), text.encode(), ex=LOG_TTL_SECONDS)
        published += 1
    return published


def read_log_tail(replica_id: int) -> str | None:
    raw = get_redis().get(log_key(replica_id))
    return raw.decode("utf-8", "replace") if raw is not None else None
