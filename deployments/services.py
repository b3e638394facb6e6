"""Rules for the model catalogue, grants, nodes and deployments' desired state."""

import fnmatch
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Q, QuerySet

from deployments.choices import DeploymentState, DesiredState, NodeStatus, Visibility
from deployments.engine_args import validate_engine_args
from deployments.models import CatalogModel, Deployment, ModelGrant, Node
from gateway.invalidation import publish_change
from tenants.audit import Actor, diff, record, snapshot
from tenants.choices import AuditAction, ModelAccess
from tenants.models import ApiKey, Tenant

MODEL_FIELDS = [
    "served_name",
    "source",
    "revision",
    "task",
    "params_billions",
    "active_params_billions",
    "quantization",
    "context_length",
    "visibility",
    "trust_remote_code",
]
NODE_FIELDS = [
    "name",
    "docker_url",
    "queue",
    "engine_host",
    "arch",
    "gpu_description",
    "gpu_count",
    "total_memory_bytes",
    "unified_memory",
    "status",
]
DEPLOYMENT_FIELDS = ["name", "model", "node", "image", "engine_args", "replicas", "desired_state"]


# --- Catalogue and access ---------------------------------------------------------------


def models_for_tenant(tenant: Tenant) -> QuerySet[CatalogModel]:
    """The catalogue models a tenant may call."""
    visible = CatalogModel.objects.filter(
        Q(visibility=Visibility.PUBLIC) | Q(grants__tenant=tenant)
    )
    if tenant.model_access == ModelAccess.LISTED:
        visible = visible.filter(pk__in=tenant.allowed_models.values("pk"))
    return visible.distinct()


def models_for_key(key: ApiKey) -> QuerySet[CatalogModel]:
    """The models one API key may call: its tenant's, narrowed by the key's own list."""
    allowed = models_for_tenant(key.tenant)
    if key.allowed_models.exists():
        allowed = allowed.filter(pk__in=key.allowed_models.values("pk"))
    return allowed


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
            raise ValidationError(
                {"served_name": "Stop and remove its deployments before renaming."}
            )
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
        raise ValidationError(
            {"detail": "The model has deployments or usage; make it private instead."}
        )
    record(actor, AuditAction.DELETE, model)
    publish_change("model", model.pk)
    model.delete()


def grant_model(actor: Actor, model: CatalogModel, tenant: Tenant) -> ModelGrant:
    """Let a tenant use a private model."""
    try:
        with transaction.atomic():
            grant = ModelGrant.objects.create(model=model, tenant=tenant)
    except IntegrityError:
        raise ValidationError({"tenant": f"{tenant} already has {model}."}) from None
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
    """Change a node's settings or status."""
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
        raise ValidationError(
            {"detail": "Deployments are pinned to this node; move or remove them first."}
        )
    record(actor, AuditAction.DELETE, node)
    node.delete()


# --- Deployments ----------------------------------------------------------------------------


def check_image(image: str) -> str:
    """The image if an allow-list pattern matches it, else a ValidationError."""
    image = image.strip()
    if not any(fnmatch.fnmatchcase(image, pattern) for pattern in settings.TOLLGATE_ENGINE_IMAGES):
        allowed = ", ".join(settings.TOLLGATE_ENGINE_IMAGES)
        raise ValidationError(
            {"image": f"{image!r} is not an allowed engine image (allowed: {allowed})."}
        )
    return image


def _validate_deployment(deployment: Deployment) -> None:
    deployment.image = check_image(deployment.image)
    deployment.engine_args = validate_engine_args(
        deployment.engine_args, trust_remote_code_allowed=deployment.model.trust_remote_code
    )
    if deployment.node and deployment.node.status == NodeStatus.DISABLED:
        raise ValidationError({"node": f"Node {deployment.node} is disabled."})
    deployment.full_clean()


@transaction.atomic
def create_deployment(actor: Actor, **fields: Any) -> Deployment:
    """Record what should run; the reconciler makes it so."""
    user = actor if actor is not None and actor.is_authenticated else None
    deployment = Deployment(created_by=user, **fields)
    _validate_deployment(deployment)
    deployment.save()
    record(actor, AuditAction.CREATE, deployment, changes=snapshot(deployment, DEPLOYMENT_FIELDS))
    return deployment


@transaction.atomic
def update_deployment(actor: Actor, deployment: Deployment, **changes: Any) -> Deployment:
    """Change image, arguments or replicas; running replicas are replaced by the reconciler."""
    before = snapshot(deployment, DEPLOYMENT_FIELDS)
    for name, value in changes.items():
        setattr(deployment, name, value)
    _validate_deployment(deployment)
    deployment.save()
    record(
        actor,
        AuditAction.UPDATE,
        deployment,
        changes=diff(before, snapshot(deployment, DEPLOYMENT_FIELDS)),
    )
    publish_change("deployment", deployment.pk)
    return deployment


def set_desired_state(actor: Actor, deployment: Deployment, desired: str) -> Deployment:
    """Ask for a deployment to run or stop (compare-and-set, safe to repeat)."""
    if desired not in DesiredState.values:
        raise ValidationError({"desired_state": f"Unknown state {desired!r}."})
    updated = (
        Deployment.objects.filter(pk=deployment.pk)
        .exclude(desired_state=desired)
        .update(desired_state=desired)
    )
    deployment.refresh_from_db()
    if updated:
        record(actor, AuditAction.ACTION, deployment, changes={"desired_state": desired})
        publish_change("deployment", deployment.pk)
    return deployment


def delete_deployment(actor: Actor, deployment: Deployment) -> None:
    """Remove a stopped deployment."""
    if deployment.state not in {
        DeploymentState.STOPPED,
        DeploymentState.PENDING,
        DeploymentState.FAILED,
    }:
        raise ValidationError({"detail": "Stop the deployment before removing it."})
    record(actor, AuditAction.DELETE, deployment)
    publish_change("deployment", deployment.pk)
    deployment.delete()
