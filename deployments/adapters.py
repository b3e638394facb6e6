"""LoRA adapters in the catalogue: who owns and sees one, and the check of its files.

An adapter belongs to a base model and (usually) to a tenant, whose admins manage it; it is
private to that tenant unless an admin grants it to others or makes it public. Tenants call
it by its served name wherever they would name a model. Before anyone can, a worker checks
its files on a node that serves the base with adapters enabled (``--enable-lora``):
``adapter_config.json`` present, weights in safetensors only, its rank within the base
deployments' ``--max-lora-rank`` and its target modules ones the base has. Loading it into
engines is deployments/adapter_loading.py.
"""

from __future__ import annotations

import json
import posixpath
import re
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from core.changes import publish_change
from core.errors import Conflict
from core.tasks import enqueue
from deployments import adapter_files, adapter_loading, runtime
from deployments.access import models_for_tenant
from deployments.choices import (
    AdapterStatus,
    DeploymentState,
    OperationKind,
    OperationStatus,
    ReplicaState,
    Task,
    Visibility,
)
from deployments.models import (
    ADAPTER_FIELDS,
    Adapter,
    AdapterGrant,
    CatalogModel,
    Deployment,
    Node,
    Operation,
    Replica,
)
from deployments.operations import (
    CONTROL_QUEUE,
    EXPECTED_FAILURES,
    EngineFailed,
    queue_operation,
    update_op,
)
from tenants.access import admin_tenant_ids
from tenants.audit import Actor, diff, record, snapshot
from tenants.choices import AuditAction
from tenants.models import Tenant

# An adapter's name: at most one namespace (the API addresses adapters by name).
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*(/[A-Za-z0-9][A-Za-z0-9._:-]*)?\Z")
# Files an adapter folder may hold besides its weights (what PEFT writes beside them).
HARMLESS = {"adapter_config.json", "README.md", ".gitattributes", "training_args.json"}
INSPECT_SCRIPT = (Path(__file__).parent / "adapter_inspect.py").read_text()


def _check_name(adapter: Adapter) -> None:
    """A tenant's adapters are named under its slug (``acme/support-v3``): no tenant can take,
    or learn of, a name in another's (checked before anything that could tell it is taken)."""
    slug = adapter.tenant.slug if adapter.tenant_id else None
    if slug and not adapter.served_name.startswith(f"{slug}/"):
        message = f"Name {adapter.tenant}'s adapters {slug}/<name>, e.g. {slug}/support-v3."
        raise ValidationError({"served_name": message})


def _check_name_taken(adapter: Adapter) -> None:
    """After the field's own validation: at most one namespace, and no model's name."""
    if not NAME_RE.match(adapter.served_name):
        message = "Use a name, or one namespace and a name (acme/support-v3): one slash at most."
        raise ValidationError({"served_name": message})
    if CatalogModel.objects.filter(served_name=adapter.served_name).exists():
        raise Conflict({"served_name": f"A model is already called {adapter.served_name!r}."})


@transaction.atomic
def create_adapter(actor: Actor, **fields: Any) -> Adapter:
    """Register an adapter; its files are checked before tenants can call it."""
    check_changes(actor, fields)
    adapter = Adapter(**fields, status=AdapterStatus.CHECKING)
    _check_name(adapter)  # first: a name in another tenant's space says nothing of theirs
    adapter.full_clean()
    _check_name_taken(adapter)
    adapter.save()
    record(actor, AuditAction.CREATE, adapter, tenant=adapter.tenant, changes=_snap(adapter))
    queue_check(actor, adapter)
    publish_change("adapter", adapter.pk)
    return adapter


@transaction.atomic
def update_adapter(actor: Actor, adapter: Adapter, **changes: Any) -> Adapter:
    """Change an adapter; a new source or base is checked again."""
    check_changes(actor, changes, adapter)
    before, old_base = _snap(adapter), adapter.base_id
    for name, value in changes.items():
        setattr(adapter, name, value)
    renamed = "served_name" in changes or "tenant" in changes
    if renamed:
        _check_name(adapter)
    adapter.full_clean()
    if renamed:
        _check_name_taken(adapter)
    recheck = before["source"] != adapter.source or before["base"] != _snap(adapter)["base"]
    if recheck:
        adapter.status, adapter.status_message = AdapterStatus.CHECKING, ""
    adapter.save()
    record(
        actor,
        AuditAction.UPDATE,
        adapter,
        tenant=adapter.tenant,
        changes=diff(before, _snap(adapter)),
    )
    if recheck:
        queue_check(actor, adapter)
        _unload_everywhere(old_base, adapter.pk)
    elif adapter.pinned and not before["pinned"] and adapter.status == AdapterStatus.READY:
        transaction.on_commit(lambda: load_everywhere(adapter))
    if before["source"] != adapter.source:  # an upload it no longer uses is not kept
        transaction.on_commit(lambda: adapter_files.remove_upload(before["source"]))
    publish_change("adapter", adapter.pk)
    return adapter


def delete_adapter(actor: Actor, adapter: Adapter) -> None:
    """Remove an adapter nothing was billed for (engines drop it on their next unload)."""
    if adapter.usage_events.exists():
        raise Conflict({"detail": "The adapter has usage; make it private instead."})
    record(actor, AuditAction.DELETE, adapter, tenant=adapter.tenant)
    publish_change("adapter", adapter.pk)
    _unload_everywhere(adapter.base_id, adapter.pk)
    source = adapter.source
    adapter.delete()
    transaction.on_commit(lambda: adapter_files.remove_upload(source))


def load_everywhere(adapter: Adapter) -> None:
    """A pinned adapter is loaded ahead of use into every ready replica serving its base."""
    replicas = Replica.objects.filter(
        deployment__model=adapter.base, state=ReplicaState.READY, healthy=True
    ).select_related("deployment__profile")
    for replica in replicas:
        if replica.deployment.serves_adapters:
            enqueue(
                "deployments.load_adapter",
                adapter.pk,
                replica.pk,
                queue=settings.TOLLGATE_DEMAND_QUEUE,
            )


def _unload_everywhere(base_id: int, adapter_id: int) -> None:
    """Once this commits, engines holding the adapter drop it (by its id: the row may go)."""
    transaction.on_commit(
        lambda: enqueue("deployments.unload_adapter", base_id, adapter_id, queue=CONTROL_QUEUE)
    )


def grant_adapter(actor: Actor, adapter: Adapter, tenant: Tenant) -> AdapterGrant:
    """Let one more tenant use a private adapter."""
    try:
        with transaction.atomic():
            grant = AdapterGrant.objects.create(adapter=adapter, tenant=tenant)
    except IntegrityError:
        raise Conflict({"tenant": f"{tenant} already has {adapter}."}) from None
    record(actor, AuditAction.GRANT, adapter, tenant=tenant, changes={"tenant": tenant.slug})
    publish_change("tenant", tenant.pk)
    return grant


def revoke_adapter_grant(actor: Actor, grant: AdapterGrant) -> None:
    """Take a shared adapter away from a tenant."""
    record(
        actor,
        AuditAction.UNGRANT,
        grant.adapter,
        tenant=grant.tenant,
        changes={"tenant": grant.tenant.slug},
    )
    publish_change("tenant", grant.tenant_id)
    grant.delete()


def _snap(adapter: Adapter) -> dict[str, Any]:
    return snapshot(adapter, ADAPTER_FIELDS)


# --- The check of its files -----------------------------------------------------------------


def serving_deployments(base: CatalogModel) -> list[Deployment]:
    """The base's deployments with adapters enabled, running ones first."""
    rows = [d for d in base.deployments.select_related("node", "profile") if d.serves_adapters]
    return sorted(rows, key=lambda d: d.state != DeploymentState.READY)


def queue_check(actor: Actor, adapter: Adapter) -> Operation | None:
    """Queue the check of the adapter's files on each node serving its base with adapters
    (each must hold the files: a hub id or an upload is put there first); with none yet, the
    adapter waits (checked when such a deployment becomes ready). The first check, or None."""
    deployments = [d for d in serving_deployments(adapter.base) if not d.external]
    nodes = serving_nodes(deployments)
    if not nodes:
        message = (
            f"Waiting for a deployment of {adapter.base} with adapters enabled "
            "(engine flag enable-lora) to check its files on."
        )
        if serving_deployments(adapter.base):  # external engines only: they load it themselves
            message = ""
            Adapter.objects.filter(pk=adapter.pk).update(status=AdapterStatus.READY)
        Adapter.objects.filter(pk=adapter.pk).update(status_message=message)
        return None
    check_round = secrets.token_hex(4)
    ops = [
        _queue_on(actor, adapter, node, deployment, check_round)
        for node, deployment in nodes.items()
    ]
    return ops[0]


def _queue_on(
    actor: Actor, adapter: Adapter, node: Node, deployment: Deployment, check_round: str
) -> Operation:
    return queue_operation(
        OperationKind.CHECK_ADAPTER,
        deployment,
        actor,
        node=node,
        model=adapter.base,
        adapter=adapter,
        image=deployment.image,
        round=check_round,
    )


def serving_nodes(deployments: list[Deployment]) -> dict[Node, Deployment]:
    """Each node the deployments run on (their pinned node and their replicas' nodes), with
    the first deployment on it (its image runs the check there)."""
    found: dict[Node, Deployment] = {}
    for deployment in deployments:
        replicas = Replica.objects.filter(deployment=deployment, node__isnull=False)
        nodes = [deployment.node] + [r.node for r in replicas.select_related("node")]
        for node in nodes:
            if node is not None and node not in found:
                found[node] = deployment
    return found


def check_waiting_adapters(deployment: Deployment) -> None:
    """A deployment serving adapters became ready: check the adapters of its base that wait,
    and put the files of the ready ones Tollgate fetches on the nodes that lack them."""
    if not deployment.serves_adapters:
        return
    waiting = deployment.model.adapters.filter(status=AdapterStatus.CHECKING)
    for adapter in waiting:
        if not adapter.operations.filter(status__in=["queued", "running"]).exists():
            with transaction.atomic():
                queue_check(None, adapter)
    if not deployment.external:
        _fetch_on_new_nodes(deployment)


def _fetch_on_new_nodes(deployment: Deployment) -> None:
    """A ready adapter whose last check did not cover one of the deployment's nodes (it
    joined later) is checked there too, in the same round: its files are put there first."""
    nodes = serving_nodes([deployment])
    for adapter in deployment.model.adapters.filter(status=AdapterStatus.READY):
        last = adapter.operations.filter(kind=OperationKind.CHECK_ADAPTER).first()
        if last is None or not adapter_files.fetchable(adapter.source):
            continue
        check_round = last.detail.get("round", "")
        covered = set(
            adapter.operations.filter(
                kind=OperationKind.CHECK_ADAPTER, detail__round=check_round
            ).values_list("node_id", flat=True)
        )
        for node, serving in nodes.items():
            if node.pk not in covered:
                with transaction.atomic():
                    _queue_on(None, adapter, node, serving, check_round)


def check_adapter(op: Operation) -> None:
    """The operation: inspect the adapter's files (and the base's module names) in a helper
    container of the engine image with the model cache mounted, then judge them. A hub id
    or an upload missing from this node's cache is put there first (downloaded or copied)."""
    adapter = op.adapter
    dc = runtime.client(op.node.docker_url)
    labels = runtime.labels_for(settings.TOLLGATE_STACK_ID, op.node.name, role="stage")
    report = _inspect(op, dc, adapter, labels)
    if adapter_files.not_found(report) and adapter_files.fetchable(adapter.source):
        _fetch(op, dc, adapter, labels)
        report = _inspect(op, dc, adapter, labels)
    errors = judge(report, adapter.base)
    fields = {
        "rank": report.get("rank"),
        "target_modules": report.get("target_modules") or [],
        "size_bytes": int(report.get("size_bytes") or 0),
        "checked_at": timezone.now(),
    }
    status = _settle(op, adapter, errors, fields)
    publish_change("adapter", adapter.pk)
    if status == AdapterStatus.READY and adapter.pinned:
        load_everywhere(adapter)
    update_op(op, message="; ".join(errors) or f"{adapter} is ready (rank {report.get('rank')})")
    if errors:
        raise EngineFailed("; ".join(errors))


def _inspect(op: Operation, dc: Any, adapter: Adapter, labels: dict[str, str]) -> dict:
    update_op(op, phase="inspect", message=f"checking {adapter.source} on {op.node.name}")
    helper = runtime.run_to_completion(
        dc,
        op.detail["image"],
        ["python3", "-c", INSPECT_SCRIPT],
        [adapter.source, adapter.base.source],
        {},
        labels,
        name=f"{settings.TOLLGATE_STACK_ID}-adapter-check-{op.pk}",
    )
    try:
        code = runtime.wait_exit(helper, 120)
        output = runtime.logs_tail(helper, 50)
    finally:
        runtime.stop_and_remove(helper, 0)
    report = _last_json(output)
    if code != 0 or report is None:
        # The check itself could not run (wrong image, no python3, killed): the adapter
        # fails with the helper's last words rather than waiting for ever.
        last = output.strip().splitlines()[-1:] or ["no output"]
        reason = f"exit code {code}" if code is not None else "it did not finish in 120 s"
        message = f"Its files could not be checked on {op.node.name} ({reason}): {last[0][:300]}"
        return {"error": message}
    return report


def _fetch(op: Operation, dc: Any, adapter: Adapter, labels: dict[str, str]) -> None:
    """Download or copy the files to this node; when that fails, so does the adapter, with
    the reason (an air-gapped node's download error, say)."""
    try:
        adapter_files.fetch(op, dc, adapter, labels)
    except EXPECTED_FAILURES as exc:
        reason = exc.summary() if isinstance(exc, adapter_files.FetchFailed) else str(exc)
        _settle(op, adapter, [reason], {"checked_at": timezone.now()})
        publish_change("adapter", adapter.pk)
        raise


def _settle(op: Operation, adapter: Adapter, errors: list[str], fields: dict[str, Any]) -> str:
    """Record this node's verdict and the adapter's status that follows (under its row lock,
    as the checks of a round on several nodes may end at once): failed when any node's check
    failed, ready once every node's passed, checking while others are still running."""
    with transaction.atomic():
        current = Adapter.objects.select_for_update().get(pk=adapter.pk)
        update_op(op, detail={**op.detail, "verdict": "failed" if errors else "passed"})
        waiting = _unsettled_nodes(op)
        if _superseded(op):  # its source or base changed since: a newer round decides
            return current.status
        if errors:
            status, message = AdapterStatus.FAILED, " ".join(errors)
        elif current.status == AdapterStatus.FAILED:  # another node's check failed this round
            status, message = current.status, current.status_message
        elif waiting:
            status = current.status
            message = f"Checked on {op.node.name}; waiting for {', '.join(waiting)}."
            if status == AdapterStatus.READY:
                message = current.status_message
        else:
            status, message = AdapterStatus.READY, ""
        Adapter.objects.filter(pk=adapter.pk).update(
            **fields, status=status, status_message=message
        )
    return status


def _superseded(op: Operation) -> bool:
    last = Operation.objects.filter(adapter_id=op.adapter_id, kind=OperationKind.CHECK_ADAPTER)
    newest = last.order_by("-created_at", "-pk").values_list("detail", flat=True).first()
    return bool(newest) and newest.get("round") != op.detail.get("round")


def _unsettled_nodes(op: Operation) -> list[str]:
    """The nodes whose check of the same round has no verdict yet."""
    siblings = Operation.objects.filter(
        adapter_id=op.adapter_id,
        kind=OperationKind.CHECK_ADAPTER,
        detail__round=op.detail.get("round"),
        status__in=[OperationStatus.QUEUED, OperationStatus.RUNNING],
    ).exclude(pk=op.pk)
    return sorted(
        {s.node.name for s in siblings.select_related("node") if "verdict" not in s.detail}
    )


def _last_json(output: str) -> dict | None:
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def judge(report: dict, base: CatalogModel) -> list[str]:
    """What is wrong with an adapter's files as the inspection found them (empty: nothing)."""
    if report.get("error"):
        return [report["error"]]
    errors = []
    files = report.get("files") or []
    unsafe = [f for f in files if not f.endswith(".safetensors") and Path(f).name not in HARMLESS]
    if unsafe:
        errors.append(
            f"Only safetensors weights are accepted; found {', '.join(sorted(unsafe)[:5])}."
        )
    if not any(f.endswith(".safetensors") for f in files):
        errors.append("No adapter weights (adapter_model.safetensors) found.")
    if report.get("peft_type") not in (None, "LORA"):
        errors.append(f"It is a {report['peft_type']} adapter; only LoRA adapters are served.")
    limit = settings.TOLLGATE_ADAPTER_MAX_BYTES
    if int(report.get("size_bytes") or 0) > limit:
        errors.append(
            f"It takes {report['size_bytes'] / 1e9:.2f} GB; the limit is {limit / 1e9:.2f} GB."
        )
    rank = report.get("rank")
    ranks = [d.max_lora_rank for d in serving_deployments(base)]
    if not isinstance(rank, int) or rank < 1:
        errors.append("adapter_config.json gives no rank (r).")
    elif ranks and rank > max(ranks):
        errors.append(
            f"Its rank {rank} is above the largest --max-lora-rank ({max(ranks)}) of the "
            f"deployments of {base}."
        )
    missing = report.get("missing_modules") or []
    if missing:
        errors.append(f"{base} has no module(s) {', '.join(missing)} to adapt.")
    return errors


# --- Added for the console's adapter pages ----------------------------------------------------


def check_again(actor: Actor, adapter: Adapter) -> Operation | None:
    """Check an adapter's files once more (after they were fixed in the model cache)."""
    if adapter.operations.filter(status__in=["queued", "running"]).exists():
        raise Conflict({"detail": f"{adapter} is being checked already."})
    with transaction.atomic():
        Adapter.objects.filter(pk=adapter.pk).update(
            status=AdapterStatus.CHECKING, status_message=""
        )
        adapter.status, adapter.status_message = AdapterStatus.CHECKING, ""
        record(actor, AuditAction.ACTION, adapter, tenant=adapter.tenant, changes={"check": True})
        op = queue_check(actor, adapter)
    publish_change("adapter", adapter.pk)
    return op


def set_adapter_grants(actor: Actor, adapter: Adapter, tenants: list[Tenant]) -> None:
    """Make ``tenants`` exactly the tenants granted the adapter (each change audit-logged)."""
    wanted = {tenant.pk: tenant for tenant in tenants}
    for grant in adapter.grants.select_related("tenant", "adapter"):
        if wanted.pop(grant.tenant_id, None) is None:
            revoke_adapter_grant(actor, grant)
    for tenant in wanted.values():
        grant_adapter(actor, adapter, tenant)


# --- Added for the admin API: what an actor may set, and where an adapter is loaded ----------

CACHE = "/root/.cache/huggingface"  # the model cache as engines mount it (adapter_inspect.py)
NOT_YOURS_TO_SHARE = (
    "Only platform admins share an adapter beyond its tenant (public, or granted to others)."
)
NOT_YOURS_TO_PIN = (
    "Only platform admins pin an adapter: it then holds an engine slot on every replica of a "
    "base all tenants share."
)
NO_OWNER = "Give your tenant's slug: only platform admins register adapters of no tenant."


def may_share(actor: Actor) -> bool:
    """Who else may call an adapter is a platform admin's choice, never a tenant admin's."""
    return actor is None or bool(actor.is_staff)


def check_changes(actor: Actor, fields: dict[str, Any], adapter: Adapter | None = None) -> None:
    """Refuse what ``actor`` may not set on an adapter (``adapter`` None: a new one), beyond
    its fields' own validation: sharing it (403) and, as 400s, no owner unless a platform
    admin's, a base its tenant may not call, a source engines cannot read or one holding an
    adapter the actor does not manage."""
    was_public = getattr(adapter, "visibility", None) == Visibility.PUBLIC
    if fields.get("visibility") == Visibility.PUBLIC and not was_public and not may_share(actor):
        raise PermissionDenied(NOT_YOURS_TO_SHARE)
    was_pinned = bool(getattr(adapter, "pinned", False))
    if fields.get("pinned") and not was_pinned and not may_share(actor):
        raise PermissionDenied(NOT_YOURS_TO_PIN)
    tenant = fields["tenant"] if "tenant" in fields else getattr(adapter, "tenant", None)
    if tenant is None and not may_share(actor):
        raise ValidationError({"tenant": NO_OWNER})
    if "base" in fields or "tenant" in fields:
        _check_base(fields.get("base") or adapter.base, tenant)
    if "source" in fields:
        check_source(actor, fields["source"], adapter)


def _check_base(base: CatalogModel, tenant: Tenant | None) -> None:
    if base.task != Task.GENERATE:
        raise ValidationError({"base": f"{base} is not a generation model; adapters need one."})
    if tenant is not None and not models_for_tenant(tenant).filter(pk=base.pk).exists():
        message = f"{tenant.slug} may not call {base}; choose a model it may call."
        raise ValidationError({"base": message})


def check_source(actor: Actor, source: str, adapter: Adapter | None = None) -> None:
    """An absolute path must be in the model cache (engines see nothing else). A tenant admin's
    source must not hold another tenant's (or the platform's) adapter: registered under a
    name of their own, its weights would be theirs to call."""
    folder = _cache_folder(source)
    if source.startswith("/") and not folder.startswith(f"{CACHE}/"):
        raise ValidationError({"source": f"An absolute path must be inside the cache, {CACHE}/."})
    if adapter_files.in_uploads(folder) and not _own_upload(source, adapter):
        message = "That folder holds Tollgate's copies of uploads: upload the archive instead."
        raise ValidationError({"source": message})
    if may_share(actor):
        return
    others = Adapter.objects.exclude(tenant_id__in=admin_tenant_ids(actor))
    if adapter is not None:
        others = others.exclude(pk=adapter.pk)
    for other in others.values_list("source", flat=True):
        theirs = _cache_folder(other)
        if folder == theirs or folder.startswith(f"{theirs}/") or theirs.startswith(f"{folder}/"):
            raise ValidationError({"source": "These files are another adapter's; use your own."})


def _own_upload(source: str, adapter: Adapter | None) -> bool:
    """Whether ``source`` is the adapter's own upload: the one it has, or one just accepted
    for it (its archive is kept, and no other adapter has that source)."""
    if adapter is not None and adapter.source == source:
        return True
    archive = adapter_files.upload_archive(source)
    taken = Adapter.objects.filter(source=source).exists()
    return archive is not None and archive.is_file() and not taken


def _cache_folder(source: str) -> str:
    """Where a source's files are: a hub id's repository folder in the cache, or the path."""
    if source.startswith("/"):
        return posixpath.normpath(source)
    return f"{CACHE}/hub/models--{source.replace('/', '--')}"


def replicas_holding(adapters: Iterable[Adapter]) -> dict[int, list[Replica]]:
    """The ready replicas of their bases that hold each adapter now (adapter id -> replicas),
    from the worker's record in Redis the gateway routes by: one read per replica."""
    held: dict[int, list[Replica]] = {adapter.pk: [] for adapter in adapters}
    bases = Adapter.objects.filter(pk__in=held).values("base_id")
    replicas = Replica.objects.filter(deployment__model_id__in=bases, state=ReplicaState.READY)
    for replica in replicas.select_related("deployment", "node").order_by("deployment", "index"):
        for adapter_id in adapter_loading.loaded(replica.pk):
            if adapter_id in held:
                held[adapter_id].append(replica)
    return held
