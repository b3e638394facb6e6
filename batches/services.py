"""Rules of the Batch API: files, batches, their state changes.

Views, tasks and the runner call these.
"""

import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import orjson
from django.conf import settings
from django.db import transaction
from django.db.models import F, Q, QuerySet
from django.utils import timezone

from batches.choices import COMPLETION_WINDOWS, ENDPOINTS, LineState, Purpose, Status
from batches.jsonl import InvalidFile, parse_requests
from batches.models import Batch, BatchLine, File
from core.tasks import enqueue
from tenants.models import ApiKey, Tenant

MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
# The Celery task that runs a batch (registered in batches/tasks.py), queued by name.
RUN_TASK = "batches.run_batch"


@dataclass
class RequestError(Exception):
    """A request the API refuses, in OpenAI's error terms."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"


def not_found(kind: str, ident: str, param: str = "id") -> RequestError:
    return RequestError(404, f"No such {kind} object: {ident}", param)


def owner_of(key: ApiKey) -> ApiKey:
    """The key work is done for: a child key acts for its parent."""
    return key.parent if key.parent_id else key


# --- Files ------------------------------------------------------------------------------------


def upload_file(key: ApiKey, filename: str, data: bytes, purpose: str) -> File:
    """Store a batch input file after checking every line."""
    if purpose != Purpose.BATCH:
        raise RequestError(400, "Tollgate accepts files with purpose 'batch' only.", "purpose")
    check_size(len(data))
    try:
        requests = parse_requests(data, settings.TOLLGATE_BATCH_MAX_LINES)
    except InvalidFile as exc:
        raise RequestError(400, str(exc), "file", exc.code) from None
    return _store(key.tenant, owner_of(key), filename, data, Purpose.BATCH, len(requests))


def check_size(size: int) -> None:
    limit = settings.TOLLGATE_BATCH_MAX_FILE_BYTES
    if size > limit:
        raise RequestError(
            400, f"The file is {size} bytes; the limit is {limit} bytes.", "file", "file_too_large"
        )


def _store(
    tenant: Tenant, key: ApiKey | None, filename: str, data: bytes, purpose: str, lines: int
) -> File:
    retention = timedelta(days=settings.TOLLGATE_FILES_RETENTION_DAYS)
    now = timezone.now()
    return File.objects.create(
        tenant=tenant,
        api_key=key,
        filename=filename[:255] or "upload.jsonl",
        purpose=purpose,
        size=len(data),
        lines=lines,
        content=data,
        created_at=now,
        expires_at=now + retention,
    )


def files_of(tenant: Tenant) -> QuerySet[File]:
    return File.objects.filter(tenant=tenant).defer("content")


def get_file(tenant: Tenant, public_id: str, with_content: bool = False) -> File:
    files = File.objects.filter(tenant=tenant) if with_content else files_of(tenant)
    found = files.filter(public_id=public_id).first()
    if found is None:
        raise not_found("File", public_id)
    return found


def delete_file(tenant: Tenant, public_id: str) -> None:
    if not File.objects.filter(tenant=tenant, public_id=public_id).delete()[0]:
        raise not_found("File", public_id)


def purge_expired_files() -> int:
    """Delete files past their retention; batches keep their ids (the content is gone)."""
    return File.objects.filter(expires_at__lte=timezone.now()).delete()[0]


def page(
    items: QuerySet, after: str | None, limit: int, ascending: bool = False
) -> tuple[list, bool]:
    """OpenAI's cursor pagination over ``public_id``: the page after ``after`` and has_more."""
    if after:
        anchor = items.filter(public_id=after).values_list("pk", flat=True).first()
        if anchor is None:
            raise RequestError(400, f"No such object for 'after': {after}", "after")
        items = items.filter(pk__gt=anchor) if ascending else items.filter(pk__lt=anchor)
    rows = list(items.order_by("pk" if ascending else "-pk")[: limit + 1])
    return rows[:limit], len(rows) > limit


# --- Batches ----------------------------------------------------------------------------------


def check_metadata(metadata: Any) -> dict | None:
    if metadata is None:
        return None
    ok = (
        isinstance(metadata, dict)
        and len(metadata) <= MAX_METADATA_KEYS
        and all(
            isinstance(k, str)
            and len(k) <= MAX_METADATA_KEY
            and isinstance(v, str)
            and len(v) <= MAX_METADATA_VALUE
            for k, v in metadata.items()
        )
    )
    if not ok:
        raise RequestError(
            400,
            f"metadata must be an object of at most {MAX_METADATA_KEYS} string pairs "
            f"(keys up to {MAX_METADATA_KEY}, values up to {MAX_METADATA_VALUE} characters).",
            "metadata",
        )
    return metadata


def create_batch(
    key: ApiKey, input_file_id: Any, endpoint: Any, completion_window: Any, metadata: Any = None
) -> Batch:
    """A batch in ``validating`` with one row per request; its run is queued after commit."""
    if endpoint not in ENDPOINTS:
        raise RequestError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}.", "endpoint")
    if completion_window not in COMPLETION_WINDOWS:
        raise RequestError(400, "completion_window must be '24h'.", "completion_window")
    metadata = check_metadata(metadata)
    if not isinstance(input_file_id, str) or not input_file_id:
        raise RequestError(400, "input_file_id is required.", "input_file_id")
    source = get_file(key.tenant, input_file_id, with_content=True)
    if source.purpose != Purpose.BATCH:
        raise RequestError(
            400,
            f"File {input_file_id} has purpose {source.purpose!r}; a batch needs purpose 'batch'.",
            "input_file_id",
        )
    requests = parse_requests(bytes(source.content), settings.TOLLGATE_BATCH_MAX_LINES)
    for request in requests:
        if request.url != endpoint:
            raise RequestError(
                400,
                f"Line {request.line}: url {request.url} does not match the batch "
                f"endpoint {endpoint}.",
                "input_file_id",
                "mismatched_endpoint",
            )
    now = timezone.now()
    with transaction.atomic():
        batch = Batch.objects.create(
            tenant=key.tenant,
            api_key=owner_of(key),
            input_file_id=source.public_id,
            endpoint=endpoint,
            completion_window=completion_window,
            metadata=metadata,
            model=requests[0].body["model"][:200],
            total=len(requests),
            created_at=now,
            expires_at=now + timedelta(seconds=COMPLETION_WINDOWS[completion_window]),
        )
        BatchLine.objects.bulk_create(
            [
                BatchLine(batch=batch, line=r.line, custom_id=r.custom_id, body=r.body)
                for r in requests
            ],
            batch_size=1000,
        )
        transaction.on_commit(lambda: queue_run(batch.pk))
    return batch


def queue_run(batch_pk: int) -> None:
    """Queue the batch's run on the batch workers' queue (the task batches.tasks registers)."""
    enqueue(RUN_TASK, batch_pk, queue=settings.TOLLGATE_BATCH_QUEUE)


def batches_of(tenant: Tenant) -> QuerySet[Batch]:
    return Batch.objects.filter(tenant=tenant)


def get_batch(tenant: Tenant, public_id: str) -> Batch:
    found = batches_of(tenant).filter(public_id=public_id).first()
    if found is None:
        raise not_found("Batch", public_id)
    return found


def cancel_batch(tenant: Tenant, public_id: str) -> Batch:
    """Ask a batch to stop: ``cancelling`` until its runner stops, then ``cancelled``."""
    batch = get_batch(tenant, public_id)
    now = timezone.now()
    mine = Batch.objects.filter(pk=batch.pk)
    if mine.filter(status=Status.VALIDATING).update(status=Status.CANCELLING, cancelling_at=now):
        # No runner has claimed it: nothing ran, so settle it here.
        finalize(batch.pk, Status.CANCELLING, Status.CANCELLED)
    elif not mine.filter(status=Status.IN_PROGRESS).update(
        status=Status.CANCELLING, cancelling_at=now
    ):
        batch.refresh_from_db()
        if batch.status not in (Status.CANCELLING, Status.CANCELLED):
            raise RequestError(
                409,
                f"Cannot cancel a batch with status {batch.status}.",
                None,
                "batch_not_cancellable",
            )
    batch.refresh_from_db()
    return batch


# --- Running: leases, results, finalizing --------------------------------------------------------


def claim(batch_pk: int, owner: str) -> Batch | None:
    """Take a batch to run: a new one, or one whose runner's lease ran out. None: someone has it."""
    now = timezone.now()
    lease = now + timedelta(seconds=settings.TOLLGATE_BATCH_LEASE_SECONDS)
    mine = Batch.objects.filter(pk=batch_pk)
    took = mine.filter(status=Status.VALIDATING).update(
        status=Status.IN_PROGRESS, in_progress_at=now, lease_owner=owner, lease_until=lease
    )
    if not took:
        took = (
            mine.filter(status__in=(Status.IN_PROGRESS, Status.CANCELLING, Status.FINALIZING))
            .filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now))
            .update(lease_owner=owner, lease_until=lease)
        )
    return mine.select_related("api_key").first() if took else None


def renew(batch_pk: int, owner: str) -> str | None:
    """Extend the lease; the batch's status, or None when another runner took it over."""
    lease = timezone.now() + timedelta(seconds=settings.TOLLGATE_BATCH_LEASE_SECONDS)
    mine = Batch.objects.filter(pk=batch_pk, lease_owner=owner)
    if not mine.update(lease_until=lease):
        return None
    return mine.values_list("status", flat=True).first()


def usage_of(result: dict) -> tuple[int, int, int, int]:
    """(input, cached, output, reasoning) tokens of a result line's answer."""
    usage = ((result.get("response") or {}).get("body") or {}).get("usage") or {}
    if not isinstance(usage, dict):
        return 0, 0, 0, 0
    details_in = usage.get("prompt_tokens_details") or {}
    details_out = usage.get("completion_tokens_details") or {}
    return (
        int(usage.get("prompt_tokens") or 0),
        int(details_in.get("cached_tokens") or 0),
        int(usage.get("completion_tokens") or 0),
        int(details_out.get("reasoning_tokens") or 0),
    )


def record_result(batch_pk: int, line_pk: int, result: dict) -> bool:
    """Store one line's result once; counters move only for the first store."""
    status = (result.get("response") or {}).get("status_code") or 0
    state = LineState.SUCCEEDED if 200 <= status < 300 else LineState.FAILED
    with transaction.atomic():
        if not BatchLine.objects.filter(pk=line_pk, state=LineState.PENDING).update(
            state=state, result=result
        ):
            return False
        tokens_in, cached, tokens_out, reasoning = usage_of(result)
        counter = "completed" if state == LineState.SUCCEEDED else "failed"
        Batch.objects.filter(pk=batch_pk).update(
            **{counter: F(counter) + 1},
            input_tokens=F("input_tokens") + tokens_in,
            cached_tokens=F("cached_tokens") + cached,
            output_tokens=F("output_tokens") + tokens_out,
            reasoning_tokens=F("reasoning_tokens") + reasoning,
        )
    return True


def result_line(custom_id: str, response: dict | None = None, error: dict | None = None) -> dict:
    return {
        "id": "batch_req_" + secrets.token_hex(12),
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }


UNRUN = {
    Status.EXPIRED: (
        "batch_expired",
        "This request could not be executed before the completion window expired.",
    ),
    Status.CANCELLED: (
        "batch_cancelled",
        "This request was not executed because the batch was cancelled.",
    ),
}
STAMP = {
    Status.COMPLETED: "completed_at",
    Status.CANCELLED: "cancelled_at",
    Status.EXPIRED: "expired_at",
    Status.FAILED: "failed_at",
}


def finalize(
    batch_pk: int, from_status: str, to_status: str, errors: list[dict] | None = None
) -> bool:
    """Write the output and error files and settle the batch, all in one transaction."""
    with transaction.atomic():
        batch = Batch.objects.select_for_update().filter(pk=batch_pk, status=from_status).first()
        if batch is None:
            return False  # another runner or a cancel moved it on
        output, failed = [], []
        for line in batch.lines.order_by("line").iterator(chunk_size=1000):
            if line.state == LineState.SUCCEEDED:
                output.append(line.result)
            elif line.state == LineState.FAILED:
                failed.append(line.result)
            elif to_status in UNRUN:
                code, message = UNRUN[to_status]
                failed.append(result_line(line.custom_id, error={"code": code, "message": message}))
        batch.output_file_id = _result_file(batch, output, "output")
        batch.error_file_id = _result_file(batch, failed, "error")
        _recount(batch)
        batch.status = to_status
        batch.errors = {"object": "list", "data": errors} if errors else batch.errors
        setattr(batch, STAMP[to_status], timezone.now())
        batch.lease_owner, batch.lease_until = "", None
        batch.save()
    return True


def _result_file(batch: Batch, lines: list[dict], kind: str) -> str:
    if not lines:
        return ""
    data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    stored = _store(
        batch.tenant,
        batch.api_key,
        f"{batch.public_id}_{kind}.jsonl",
        data,
        Purpose.BATCH_OUTPUT,
        len(lines),
    )
    return stored.public_id


def _recount(batch: Batch) -> None:
    # Counters were bumped line by line; recount from the rows so the final numbers are exact.
    totals = {"completed": 0, "failed": 0, "in": 0, "cached": 0, "out": 0, "reasoning": 0}
    for state, result in batch.lines.exclude(state=LineState.PENDING).values_list(
        "state", "result"
    ):
        totals["completed" if state == LineState.SUCCEEDED else "failed"] += 1
        tokens = usage_of(result or {})
        for name, value in zip(("in", "cached", "out", "reasoning"), tokens, strict=True):
            totals[name] += value
    batch.completed, batch.failed = totals["completed"], totals["failed"]
    batch.input_tokens, batch.cached_tokens = totals["in"], totals["cached"]
    batch.output_tokens, batch.reasoning_tokens = totals["out"], totals["reasoning"]


def stale_batches() -> QuerySet[Batch]:
    """Batches no runner holds: never claimed for ten minutes, or their runner's lease ran out."""
    now = timezone.now()
    unclaimed = Q(status=Status.VALIDATING, created_at__lt=now - timedelta(minutes=10))
    orphaned = Q(status__in=(Status.IN_PROGRESS, Status.CANCELLING, Status.FINALIZING)) & (
        Q(lease_until__isnull=True) | Q(lease_until__lt=now)
    )
    return Batch.objects.filter(unclaimed | orphaned)
