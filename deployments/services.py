"""Rules for the model catalogue, grants, nodes and deployments' desired state."""

import fnmatch
import time
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from core.changes import publish_change
from core.errors import Conflict
from core.keyspace import demand_used_key
from core.redis import get_redis
from deployments import credentials, lifecycle, placement, planner, relay, runtime
from deployments.choices import (
    DeploymentMode,
    DeploymentState,
    DesiredState,
    NodeStatus,
    OperationKind,
    ReplicaState,
)
from deployments.engine_args import validate_engine_args
from deployments.engine_env import validate_engine_env
from deployments.fleet import read_log_tail
from deployments.models import (
    ALLOWED_IMAGE_FIELDS,
    DEPLOYMENT_FIELDS,
    MODEL_FIELDS,
    NODE_FIELDS,
    PROFILE_FIELDS,
    AllowedImage,
    CatalogModel,
    Deployment,
    EngineProfile,
    ModelGrant,
    Node,
    Operation,
)
from deployments.operations import queue_operation
from tenants.audit import Actor, diff, record, snapshot
from tenants.choices import AuditAction
from tenants.models import Tenant

# Changing these replaces running containers; replicas only scales.
REPLACING_FIELDS = {
    "image",
    "engine_args",
    "env",
    "profile",
    "model",
    "node",
    "worker_node",
    "cpus",
}


# --- Catalogue and grants ---------------------------------------------------------------


@transaction.atomic
def create_model(actor: Actor, **fields: Any) -> CatalogModel:
    """Add a model to the catalogue."""
    model = CatalogModel(**fields)
    model.full_clean()
    model.save()
    record(actor, AuditAction.CREATE, model, changes=snapshot(model, MODEL_FIELDS))
    publish_change("model", model.pk)
    return model


@transaction.atomic
def update_model(actor: Actor, model: CatalogModel, **changes: Any) -> CatalogModel:
    """Change a catalogue entry (the served name stays stable while deployments use it)."""
    if "served_name" in changes and changes["served_name"] != model.served_name:
        if model.deployments.exists():
            raise Conflict({"served_name": "Stop and remove its deployments before renaming."})
    before = snapshot(model, MODEL_FIELDS)
    for name, value in changes.items():
        setattr(model, name, value)
    model.full_clean()
    model.save()
    record(actor, AuditAction.UPDATE, model, changes=diff(before, snapshot(model, MODEL_FIELDS)))
    publish_change("model", model.pk)
    return model


def delete_model(actor: Actor, model: CatalogModel) -> None:
    """Remove a catalogue entry that nothing deployed or billed refers to."""
    if model.deployments.exists() or model.usage_events.exists():
        raise Conflict({"detail": "The model has deployments or usage; make it private instead."})
    record(actor, AuditAction.DELETE, model)
    publish_change("model", model.pk)
    model.delete()


def grant_model(actor: Actor, model: CatalogModel, tenant: Tenant) -> ModelGrant:
    """Let a tenant use a private model."""
    try:
        with transaction.atomic():
            grant = ModelGrant.objects.create(model=model, tenant=tenant)
    except IntegrityError:
        raise Conflict({"tenant": f"{tenant} already has {model}."}) from None
    record(actor, AuditAction.GRANT, model, tenant=tenant, changes={"tenant": tenant.slug})
    publish_change("tenant", tenant.pk)
    return grant


def revoke_grant(actor: Actor, grant: ModelGrant) -> None:
    """Take a private model away from a tenant."""
    record(
        actor,
        AuditAction.UNGRANT,
        grant.model,
        tenant=grant.tenant,
        changes={"tenant": grant.tenant.slug},
    )
    publish_change("tenant", grant.tenant_id)
    grant.delete()


# --- Nodes ------------------------------------------------------------------------------


@transaction.atomic
def register_node(actor: Actor, name: str, **fields: Any) -> Node:
    """Add a Docker host; its worker consumes the queue ``node.<name>`` unless given."""
    fields.setdefault("queue", f"node.{name}")
    node = Node(name=name, **fields)
    node.full_clean()
    node.save()
    record(actor, AuditAction.CREATE, node, changes=snapshot(node, NODE_FIELDS))
    return node


@transaction.atomic
def update_node(actor: Actor, node: Node, **changes: Any) -> Node:
    """Change a node's settings or status (revocation is one way: ``credentials.revoke_node``)."""
    status = changes.get("status", node.status)
    if status != node.status and NodeStatus.REVOKED in (status, node.status):
        raise Conflict({"status": "Revoke a node with its revoke action; a revoked node stays so."})
    before = snapshot(node, NODE_FIELDS)
    for name, value in changes.items():
        setattr(node, name, value)
    node.full_clean()
    node.save()
    record(actor, AuditAction.UPDATE, node, changes=diff(before, snapshot(node, NODE_FIELDS)))
    publish_change("node", node.pk)
    return node


def delete_node(actor: Actor, node: Node) -> None:
    """Remove a node nothing is deployed on."""
    if node.deployments.exists():
        raise Conflict(
            {"detail": "Deployments are pinned to this node; move or remove them first."}
        )
    record(actor, AuditAction.DELETE, node)
    node.delete()
    if relay.is_relayed(node.docker_url):
        # Its credential goes with it (the periodic pass would also remove it).
        credentials.delete_acl_user(node.name)


# --- Deployments ----------------------------------------------------------------------------


def allowed_image_patterns() -> list[str]:
    """Settings' patterns plus those an admin added through the API."""
    return [
        *settings.TOLLGATE_ENGINE_IMAGES,
        *AllowedImage.objects.values_list("pattern", flat=True),
    ]


def check_image(image: str) -> str:
    """The image if an allow-list pattern matches it, else a ValidationError."""
    image = image.strip()
    patterns = allowed_image_patterns()
    if not any(fnmatch.fnmatchcase(image, pattern) for pattern in patterns):
        allowed = ", ".join(patterns)
        raise ValidationError(
            {"image": f"{image!r} is not an allowed engine image (allowed: {allowed})."}
        )
    return image


def _validate_deployment(deployment: Deployment) -> None:
    trusted = deployment.model.trust_remote_code
    deployment.engine_args = validate_engine_args(
        deployment.engine_args, trust_remote_code_allowed=trusted
    )
    deployment.env = validate_engine_env(deployment.env)
    if deployment.external:
        _validate_external(deployment)
    else:
        if not deployment.image and deployment.profile_id:
            deployment.image = deployment.profile.image
        if not deployment.image:
            raise ValidationError({"image": "Give an engine image or a profile."})
        deployment.image = check_image(deployment.image)
        # The profile's defaults are checked too: a model may not inherit remote code.
        validate_engine_args(deployment.effective_args, trust_remote_code_allowed=trusted)
        validate_engine_env(deployment.effective_env)
    if deployment.node and deployment.node.status == NodeStatus.DISABLED:
        raise ValidationError({"node": f"Node {deployment.node} is disabled."})
    if not deployment.external:
        _validate_group(deployment)
    _validate_cpus(deployment)
    _validate_mode(deployment)
    deployment.full_clean()


def _validate_cpus(deployment: Deployment) -> None:
    if deployment.cpus is None:
        return
    deployment.cpus = Decimal(deployment.cpus).quantize(Decimal("0.01"))
    if deployment.external:
        raise ValidationError(
            {"cpus": "Tollgate does not start an external engine: it cannot limit its CPUs."}
        )
    node = deployment.node
    if node and node.cpu_count and deployment.cpus > node.cpu_count:
        raise ValidationError(
            {"cpus": f"Node {node} has {node.cpu_count} CPU cores; give at most {node.cpu_count}."}
        )


def _validate_mode(deployment: Deployment) -> None:
    if not deployment.on_demand:
        return
    if deployment.external:
        raise ValidationError(
            {"mode": "Tollgate does not start an external engine: it cannot run on demand."}
        )
    if placement.spans_nodes(deployment):
        raise ValidationError(
            {"mode": "An on-demand deployment runs on one node; this one's replicas span two."}
        )


def _validate_group(deployment: Deployment) -> None:
    """Tensor parallelism over nodes: two nodes, and a profile that can start a Ray group."""
    if not placement.spans_nodes(deployment):
        deployment.worker_node = None
        return
    if placement.tensor_parallel_size(deployment) > 2 * max(
        deployment.node.gpu_count if deployment.node else 1, 1
    ):
        raise ValidationError(
            {
                "engine_args": "Tollgate runs tensor parallelism over at most "
                "two nodes (--tensor-parallel-size 2 on one-GPU nodes)."
            }
        )
    cluster = deployment.profile.cluster if deployment.profile_id and deployment.profile else {}
    if not cluster.get("head_entrypoint") or not cluster.get("worker_entrypoint"):
        raise ValidationError(
            {
                "profile": "Tensor parallelism over two nodes needs a profile "
                "that starts a Ray group (e.g. dgx-spark)."
            }
        )
    if deployment.worker_node_id and deployment.worker_node_id == deployment.node_id:
        raise ValidationError({"worker_node": "Pick a second node, not the head's."})
    if deployment.worker_node_id and not deployment.node_id:
        raise ValidationError({"node": "Name the head node too, or neither."})


def _queue(kind: str, deployment: Deployment, actor: Actor) -> Operation | None:
    """Queue ``kind`` on each node that runs (or is to run) replicas of the deployment.

    Deploys, scales and restarts place replicas first (pinned node, or the node with the
    most free memory). Returns the first operation (None when there is nothing to do).
    """
    if kind in (OperationKind.DEPLOY, OperationKind.SCALE, OperationKind.RESTART):
        try:
            placement.place(deployment)
        except placement.NoRoom as exc:
            raise ValidationError({"memory": str(exc)}) from None
    node_ids = set(deployment.replica_set.exclude(node=None).values_list("node_id", flat=True))
    if deployment.node_id:
        node_ids.add(deployment.node_id)
    nodes = list(Node.objects.filter(pk__in=node_ids).order_by("name"))
    if kind in (OperationKind.STOP, OperationKind.REMOVE):
        nodes = _release_revoked(deployment, kind, nodes)
    ops = [queue_operation(kind, deployment, actor, node=node) for node in nodes]
    if not ops and kind == OperationKind.STOP:
        # Nothing placed anywhere: nothing to drain, so it is stopped already.
        Deployment.objects.filter(pk=deployment.pk, desired_state=DesiredState.STOPPED).update(
            state=DeploymentState.STOPPED, state_message=""
        )
    return ops[0] if ops else None


def _release_revoked(deployment: Deployment, kind: str, nodes: list[Node]) -> list[Node]:
    """The nodes that can still do ``kind``. A revoked node takes no more work (its agent is
    cut off): its replicas, out of routing since the revocation, are stopped (or removed)
    here, and their engines keep running on that box until its own admin stops them."""
    revoked = [node for node in nodes if node.status == NodeStatus.REVOKED]
    if revoked:
        rows = deployment.replica_set.filter(node__in=revoked)
        if kind == OperationKind.REMOVE:
            rows.delete()
        else:
            lifecycle.mark_stopped(rows)
    return [node for node in nodes if node.status != NodeStatus.REVOKED]


def _validate_external(deployment: Deployment) -> None:
    if not deployment.external_url.startswith(("http://", "https://")):
        raise ValidationError({"external_url": "Give the engine's http(s) base URL."})
    deployment.external_url = deployment.external_url.rstrip("/").removesuffix("/v1")
    deployment.image, deployment.node, deployment.env = "", None, {}


def memory_fit(deployment: Deployment) -> planner.FitResult | None:
    """The memory-fit verdict for a deployment on its node (None: nothing to check)."""
    node = deployment.node
    if deployment.external or node is None:
        return None
    args, model = deployment.effective_args, deployment.model
    pool = (
        node.gpu_memory_bytes
        if node.gpu_memory_bytes and not node.unified_memory
        else (node.total_memory_bytes if node.unified_memory or node.gpu_count else 0)
    )
    # A replica spanning two nodes holds half its weights and KV cache on each.
    share = placement.nodes_per_replica(deployment)
    active = _float_or_none(model.active_params_billions)
    need = planner.footprint(
        params_billions=float(model.params_billions) / share,
        quantization=model.quantization,
        max_model_len=int(args.get("max-model-len") or model.context_length),
        max_num_seqs=int(args.get("max-num-seqs") or planner.DEFAULT_MAX_NUM_SEQS),
        kv_bytes_per_token=(model.kv_bytes_per_token // share)
        if model.kv_bytes_per_token
        else None,
        kv_cache_dtype=str(args.get("kv-cache-dtype", "auto")),
        gpu_memory_utilization=args.get("gpu-memory-utilization"),
        pool_bytes=pool,
        active_params_billions=active / share if active is not None else None,
    )
    others = held = 0
    neighbours = (
        Deployment.objects.filter(node=node, desired_state=DesiredState.RUNNING, external=False)
        .exclude(pk=deployment.pk)
        .select_related("model", "profile")
    )
    for other in neighbours:
        verdict_need = _replica_bytes(other, pool)
        running = other.replica_set.exclude(
            state__in=[ReplicaState.STOPPED, ReplicaState.CRASHED, ReplicaState.FAILED]
        ).count()
        held += verdict_need * running
        if not other.on_demand:
            others += verdict_need * other.replicas
        elif not deployment.on_demand and other.awake:
            # An on-demand model holds memory while awake; another on-demand one's start
            # puts it to sleep to make room (deployments/demand.py), an always-running one's
            # does not.
            others += verdict_need * other.replicas
    cap = placement.capacity(node, held)
    return planner.check_fit(need, deployment.replicas, others, node.name, cap)


def preview_fit(
    model: CatalogModel,
    node: Node | None,
    profile: EngineProfile | None,
    replicas: int,
    engine_args: dict[str, Any],
    mode: str = DeploymentMode.ALWAYS,
) -> planner.FitResult | None:
    """The memory-fit verdict a deployment with these values would get; nothing is saved.

    The flags (and the profile's, which they override) are checked as create_deployment
    checks them: a ValidationError names what the allow-list refuses.
    """
    trusted = model.trust_remote_code
    args = validate_engine_args(engine_args, trust_remote_code_allowed=trusted)
    deployment = Deployment(
        name="preview",
        model=model,
        node=node,
        profile=profile,
        replicas=replicas,
        engine_args=args,
        mode=mode,
    )
    deployment.engine_args = validate_engine_args(
        deployment.effective_args, trust_remote_code_allowed=trusted
    )
    return memory_fit(deployment)


def _replica_bytes(deployment: Deployment, pool: int) -> int:
    args, model = deployment.effective_args, deployment.model
    return planner.footprint(
        float(model.params_billions),
        model.quantization,
        int(args.get("max-model-len") or model.context_length),
        int(args.get("max-num-seqs") or planner.DEFAULT_MAX_NUM_SEQS),
        model.kv_bytes_per_token,
        str(args.get("kv-cache-dtype", "auto")),
        args.get("gpu-memory-utilization"),
        pool,
        _float_or_none(model.active_params_billions),
    ).per_replica


def _float_or_none(value: Any) -> float | None:
    return float(value) if value is not None else None


def _check_memory_fit(deployment: Deployment) -> None:
    if deployment.desired_state != DesiredState.RUNNING or deployment.external:
        return
    if deployment.node is None:
        # Placed by Tollgate: some online node (or pair of nodes) must fit it.
        try:
            placement.check_placeable(deployment)
        except placement.NoRoom as exc:
            raise ValidationError({"memory": str(exc)}) from None
        return
    verdict = memory_fit(deployment)
    if verdict is not None and not verdict.fits:
        raise ValidationError({"memory": verdict.message})


@transaction.atomic
def create_deployment(actor: Actor, **fields: Any) -> Deployment:
    """Record what should run and queue its deploy (refused when it cannot fit the node)."""

    user = actor if actor is not None and actor.is_authenticated else None
    deployment = Deployment(created_by=user, **fields)
    _validate_deployment(deployment)
    _check_memory_fit(deployment)
    if deployment.on_demand:
        deployment.state = DeploymentState.STOPPED  # started by its first request
    deployment.save()
    record(actor, AuditAction.CREATE, deployment, changes=snapshot(deployment, DEPLOYMENT_FIELDS))
    if deployment.wanted_running and not deployment.external:
        _queue(OperationKind.DEPLOY, deployment, actor)
    publish_change("deployment", deployment.pk)
    return deployment


def _change_mode(deployment: Deployment) -> None:
    """Going on demand, what runs stays awake until idle (its clock starts now); going
    always-running, it runs whatever it was."""
    if deployment.on_demand:
        live = deployment.replica_set.exclude(state=ReplicaState.STOPPED).exists()
        deployment.awake = live
        if live:
            get_redis().zadd(demand_used_key(), {str(deployment.pk): time.time()})
    else:
        deployment.awake = False


@transaction.atomic
def update_deployment(actor: Actor, deployment: Deployment, **changes: Any) -> Deployment:
    """Change image, arguments or replicas; running replicas are replaced or scaled."""

    if "external" in changes and changes["external"] != deployment.external:
        raise ValidationError({"external": "Create a new deployment to change this."})
    before, old_key = snapshot(deployment, DEPLOYMENT_FIELDS), deployment.upstream_key
    was_on_demand = deployment.on_demand
    for name, value in changes.items():
        setattr(deployment, name, value)
    _validate_deployment(deployment)
    if deployment.on_demand != was_on_demand:
        _change_mode(deployment)
    _check_memory_fit(deployment)
    deployment.save()
    changed = diff(before, snapshot(deployment, DEPLOYMENT_FIELDS))
    if deployment.upstream_key != old_key:
        changed["upstream_key"] = "changed"  # a new key for an old one: never either key
    record(actor, AuditAction.UPDATE, deployment, changes=changed)
    if deployment.wanted_running and not deployment.external:
        if REPLACING_FIELDS & changed.keys():
            _queue(OperationKind.RESTART, deployment, actor)
        elif "replicas" in changed or "mode" in changed:
            _queue(OperationKind.SCALE, deployment, actor)
    publish_change("deployment", deployment.pk)
    return deployment


def set_desired_state(actor: Actor, deployment: Deployment, desired: str) -> Deployment:
    """Ask for a deployment to run or stop (compare-and-set, safe to repeat)."""

    if desired not in DesiredState.values:
        raise ValidationError({"desired_state": f"Unknown state {desired!r}."})
    if desired == DesiredState.RUNNING:
        deployment.desired_state = desired
        _check_memory_fit(deployment)
    with transaction.atomic():
        updated = (
            Deployment.objects.filter(pk=deployment.pk)
            .exclude(desired_state=desired)
            .update(desired_state=desired)
        )
        if desired == DesiredState.RUNNING and deployment.state == DeploymentState.FAILED:
            # Starting a failed deployment again is the admin's "try again".
            Deployment.objects.filter(pk=deployment.pk).update(state=DeploymentState.PENDING)
            deployment.replica_set.update(crash_count=0, next_restart_at=None)
            updated = updated or 1
        deployment.refresh_from_db()
        if updated:
            if desired == DesiredState.STOPPED and deployment.on_demand:
                Deployment.objects.filter(pk=deployment.pk).update(awake=False)
            record(actor, AuditAction.ACTION, deployment, changes={"desired_state": desired})
            publish_change("deployment", deployment.pk)
            if desired == DesiredState.STOPPED and not deployment.external:
                _queue(OperationKind.STOP, deployment, actor)
            elif deployment.wanted_running and not deployment.external:
                _queue(OperationKind.DEPLOY, deployment, actor)
            elif deployment.on_demand:  # ready to be started by its next request
                Deployment.objects.filter(pk=deployment.pk).update(state=DeploymentState.STOPPED)
    return deployment


def delete_deployment(actor: Actor, deployment: Deployment) -> None:
    """Remove a stopped deployment."""
    if deployment.state not in {
        DeploymentState.STOPPED,
        DeploymentState.PENDING,
        DeploymentState.FAILED,
    }:
        raise Conflict({"detail": "Stop the deployment before removing it."})
    record(actor, AuditAction.DELETE, deployment)
    publish_change("deployment", deployment.pk)
    deployment.delete()


def restart_deployment(actor: Actor, deployment: Deployment) -> Operation:
    """Replace every replica (drain, stop, start again), one after the other."""

    if deployment.external:
        raise Conflict({"detail": "Tollgate does not run external engines."})
    if deployment.desired_state != DesiredState.RUNNING:
        raise Conflict({"detail": "Start the deployment instead."})
    with transaction.atomic():
        record(actor, AuditAction.ACTION, deployment, changes={"restart": True})
        return _queue(OperationKind.RESTART, deployment, actor)


def remove_deployment(actor: Actor, deployment: Deployment) -> Operation | None:
    """Drain, stop and remove the containers, then the deployment itself."""

    with transaction.atomic():
        Deployment.objects.filter(pk=deployment.pk).update(desired_state=DesiredState.STOPPED)
        record(actor, AuditAction.DELETE, deployment)
        publish_change("deployment", deployment.pk)
        op = None if deployment.external else _queue(OperationKind.REMOVE, deployment, actor)
        if op is None:
            deployment.delete()
        return op


def replica_logs(deployment: Deployment, index: int, lines: int = 200) -> str:
    """The last lines an engine container printed (empty when it is gone)."""
    replica = deployment.replica_set.filter(index=index).first()
    node = (replica.node or deployment.node) if replica else None
    if replica is None or node is None or not replica.container_name:
        return ""
    # The node's worker copies log tails into Redis on every reconcile pass; the web
    # process of the appliance has no Docker access at all.
    published = read_log_tail(replica.pk)
    if published is not None:
        return "\n".join(published.splitlines()[-min(lines, 5000) :])
    try:
        container = runtime.find(runtime.client(node.docker_url), replica.container_name)
    except runtime.RuntimeFailure:
        raise ValidationError(
            {
                "detail": "The engine's log has not been reported by its node yet; "
                "it appears within a few seconds of the node's next reconcile."
            }
        ) from None
    return runtime.logs_tail(container, min(lines, 5000)) if container else ""


# --- Engine profiles and allowed images -------------------------------------------------------


def _validate_profile(profile: EngineProfile) -> None:
    profile.image = check_image(profile.image)
    # A profile may not switch on remote code: that is the model's decision.
    profile.engine_args = validate_engine_args(profile.engine_args)
    profile.env = validate_engine_env(profile.env)
    profile.full_clean()


@transaction.atomic
def save_profile(actor: Actor, profile: EngineProfile, **changes: Any) -> EngineProfile:
    """Create or change an engine profile (built-in ones are read-only)."""
    if profile.builtin:
        raise Conflict({"detail": "Built-in profiles are read-only; copy one instead."})
    before = snapshot(profile, PROFILE_FIELDS) if profile.pk else {}
    for name, value in changes.items():
        setattr(profile, name, value)
    _validate_profile(profile)
    profile.save()
    action = AuditAction.UPDATE if before else AuditAction.CREATE
    record(actor, action, profile, changes=diff(before, snapshot(profile, PROFILE_FIELDS)))
    return profile


def delete_profile(actor: Actor, profile: EngineProfile) -> None:
    if profile.builtin:
        raise Conflict({"detail": "Built-in profiles cannot be removed."})
    record(actor, AuditAction.DELETE, profile)
    profile.delete()


@transaction.atomic
def allow_image(actor: Actor, pattern: str, note: str = "") -> AllowedImage:
    """Add an engine image pattern to the allow-list."""
    allowed = AllowedImage(pattern=pattern.strip(), note=note)
    if any(c in allowed.pattern for c in " \t\n;|&$`"):
        raise ValidationError({"pattern": "An image reference or fnmatch pattern, no spaces."})
    allowed.full_clean()
    allowed.save()
    record(actor, AuditAction.CREATE, allowed, changes=snapshot(allowed, ALLOWED_IMAGE_FIELDS))
    return allowed


def disallow_image(actor: Actor, allowed: AllowedImage) -> None:
    """Remove a pattern; running deployments keep running, new ones are refused."""
    record(actor, AuditAction.DELETE, allowed, changes={"pattern": allowed.pattern})
    allowed.delete()
