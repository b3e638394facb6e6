"""Pre-staging weights: download a model into a node's shared cache before its first deploy.

A short-lived container of an engine image runs the Hugging Face CLI with the cache
volume mounted and ``HF_TOKEN`` set; its progress bar becomes the operation's progress.
A second helper measures the size on disk. Deploys then load from the cache instead of
doubling as a 60 GB download.
"""

import time

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from deployments import progress, runtime
from deployments.choices import OperationKind
from deployments.models import CatalogModel, Node, Operation, StagedModel
from deployments.operations import EngineFailed, queue_operation, update_op
from deployments.services import check_image
from tenants.audit import Actor, record
from tenants.choices import AuditAction

CACHE = "/root/.cache/huggingface"


def cache_dir(source: str) -> str:
    """Where the Hugging Face hub keeps a repo inside the cache volume."""
    return f"{CACHE}/hub/models--{source.replace('/', '--')}"


@transaction.atomic
def stage_weights(actor: Actor, model: CatalogModel, node: Node, image: str) -> Operation:
    """Queue a download of the model's weights into ``node``'s model cache."""
    if model.source.startswith("/"):
        raise ValidationError(
            {"model": "The model is a path in the cache already; nothing to download."}
        )
    check_image(image)
    record(actor, AuditAction.ACTION, model, changes={"stage": node.name, "image": image})
    return queue_operation(OperationKind.STAGE, None, actor, node=node, model=model, image=image)


def stage(op: Operation) -> None:
    """Run the download helper on the node, then measure and record what it stored."""
    model, node = op.model, op.node
    dc = runtime.client(node.docker_url)
    stack = settings.TOLLGATE_STACK_ID
    labels = runtime.labels_for(stack, node.name, role="stage")
    command = [model.source] + (["--revision", model.revision] if model.revision else [])
    env = {"HF_TOKEN": settings.HF_TOKEN} if settings.HF_TOKEN else {}
    update_op(op, phase="download", message=f"downloading {model.source} on {node.name}")
    helper = runtime.run_to_completion(
        dc,
        op.detail["image"],
        settings.TOLLGATE_STAGE_ENTRYPOINT,
        command,
        env,
        labels,
        name=f"{stack}-stage-{op.pk}",
    )
    try:
        code = _follow(op, helper)
        if code != 0:
            tail = runtime.logs_tail(helper, settings.TOLLGATE_LOG_TAIL_LINES)
            raise EngineFailed(f"the download exited with code {code}", code, tail)
    finally:
        runtime.stop_and_remove(helper, 0)
    update_op(op, phase="measure", progress=99.0)
    size = measure(dc, op, model, labels)
    StagedModel.objects.update_or_create(
        model=model,
        node=node,
        defaults={"size_bytes": size, "revision": model.revision, "staged_at": timezone.now()},
    )
    update_op(op, message=f"{model.source} staged on {node.name}: {size / 1e9:.1f} GB")


def _follow(op: Operation, helper: object) -> int:
    deadline = time.monotonic() + settings.TOLLGATE_STAGE_TIMEOUT
    while time.monotonic() < deadline:
        runtime.refresh(helper)
        pct = progress.download_progress(runtime.logs_tail(helper, 20))
        if pct is not None:
            update_op(op, progress=round(min(pct, 98.0), 1))
        if helper.status in {"exited", "dead"}:
            return runtime.exit_code(helper)
        time.sleep(settings.TOLLGATE_ENGINE_POLL_SECONDS)
    raise EngineFailed("the download did not finish in time")


def measure(dc: object, op: Operation, model: CatalogModel, labels: dict[str, str]) -> int:
    """Bytes the model takes in the cache (``du`` in a helper of the same image)."""
    helper = runtime.run_to_completion(
        dc,
        op.detail["image"],
        ["du", "-sbL"],
        [cache_dir(model.source)],
        {},
        labels,
        name=f"{labels[runtime.LABEL_STACK]}-measure-{op.pk}",
    )
    try:
        runtime.wait_exit(helper, 300)
        output = runtime.logs_tail(helper, 5).split()
        return int(output[0]) if output and output[0].isdigit() else 0
    finally:
        runtime.stop_and_remove(helper, 0)
