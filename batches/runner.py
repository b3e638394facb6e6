"""Runs a batch: each pending line goes to the gateway as a P2 request with a child key.

The runner holds the batch under a lease it renews while working. Results are stored per
line as they arrive, so a runner killed mid-batch loses nothing: whoever claims the batch
after the lease runs out continues with the lines that have no result yet.
"""

import logging
import secrets
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import timedelta

import httpx
import orjson
from django.conf import settings
from django.utils import timezone

from batches import services
from batches.choices import LineState, Status
from batches.models import Batch, BatchLine
from tenants.models import ApiKey
from tenants.services import issue_child_key, revoke_api_key

log = logging.getLogger("tollgate.batches")

PRIORITY_HEADER = "X-Tollgate-Priority"
# A fresh child key reaches every gateway process through pub/sub within about a second;
# until then a gateway may answer 401, which is worth waiting out, not recording.
KEY_PROPAGATION_SECONDS = 15.0
RENEW_EVERY_SECONDS = 1.0
PAGE = 200


@dataclass
class Line:
    pk: int
    custom_id: str
    body: dict


@dataclass
class Run:
    """One runner's hold on one batch."""

    batch: Batch
    owner: str
    stop: threading.Event = field(default_factory=threading.Event)
    key_issued: float = field(default_factory=time.monotonic)
    last_pk: int = 0
    lost: bool = False
    outcome: str = Status.COMPLETED


def run_batch(batch_pk: int) -> str:
    """Run (or continue, or settle) a batch; returns the status it was left in."""
    owner = secrets.token_hex(8)
    batch = services.claim(batch_pk, owner)
    if batch is None:
        return "not claimed"
    if batch.status == Status.FINALIZING:
        services.finalize(batch.pk, Status.FINALIZING, Status.COMPLETED)
        return _status(batch.pk)
    if batch.status == Status.CANCELLING:
        services.finalize(batch.pk, Status.CANCELLING, Status.CANCELLED)
        return _status(batch.pk)
    if timezone.now() >= batch.expires_at:
        services.finalize(batch.pk, Status.IN_PROGRESS, Status.EXPIRED)
        return _status(batch.pk)
    parent = batch.api_key
    if not ApiKey.objects.usable().filter(pk=parent.pk).exists():
        services.finalize(
            batch.pk,
            Status.IN_PROGRESS,
            Status.FAILED,
            errors=[
                {
                    "code": "api_key_unusable",
                    "line": None,
                    "param": None,
                    "message": (
                        "The API key that created this batch was revoked or expired, "
                        "or its tenant is suspended."
                    ),
                }
            ],
        )
        return _status(batch.pk)
    _revoke_children(parent, batch)  # a runner that died left its key behind
    issued = issue_child_key(
        parent, name=f"batch {batch.public_id}", expires_at=batch.expires_at + timedelta(minutes=10)
    )
    try:
        run = Run(batch=batch, owner=owner)
        _dispatch(run, issued.plaintext)
    finally:
        revoke_api_key(None, issued.key)
    if not run.lost:
        _settle(run)
    return _status(batch.pk)


def _status(batch_pk: int) -> str:
    return Batch.objects.filter(pk=batch_pk).values_list("status", flat=True).first() or "gone"


def _revoke_children(parent: ApiKey, batch: Batch) -> None:
    for child in parent.children.filter(name=f"batch {batch.public_id}", revoked_at__isnull=True):
        revoke_api_key(None, child)


def _settle(run: Run) -> None:
    pk = run.batch.pk
    if run.outcome == Status.EXPIRED:
        services.finalize(pk, Status.IN_PROGRESS, Status.EXPIRED) or services.finalize(
            pk, Status.CANCELLING, Status.EXPIRED
        )
        return
    now = timezone.now()
    if Batch.objects.filter(pk=pk, status=Status.IN_PROGRESS).update(
        status=Status.FINALIZING, finalizing_at=now
    ):
        services.finalize(pk, Status.FINALIZING, Status.COMPLETED)
    else:  # cancelled while the last answers came in
        services.finalize(pk, Status.CANCELLING, Status.CANCELLED)


def _next_lines(run: Run) -> list[Line]:
    rows = (
        BatchLine.objects.filter(batch_id=run.batch.pk, state=LineState.PENDING, pk__gt=run.last_pk)
        .order_by("pk")
        .values_list("pk", "custom_id", "body")[:PAGE]
    )
    lines = [Line(*row) for row in rows]
    if lines:
        run.last_pk = lines[-1].pk
    return lines


def _check(run: Run) -> None:
    """Renew the lease and notice cancel, expiry or a takeover."""
    status = services.renew(run.batch.pk, run.owner)
    if status is None:
        run.lost = True
        run.stop.set()
    elif status == Status.CANCELLING:
        run.outcome = Status.CANCELLED
        run.stop.set()
    elif timezone.now() >= run.batch.expires_at:
        run.outcome = Status.EXPIRED
        run.stop.set()


def _dispatch(run: Run, key: str) -> None:
    concurrency = max(1, settings.TOLLGATE_BATCH_CONCURRENCY)
    headers = {
        "Authorization": f"Bearer {key}",
        PRIORITY_HEADER: "P2",
        "Content-Type": "application/json",
    }
    timeout = httpx.Timeout(settings.TOLLGATE_BATCH_REQUEST_TIMEOUT, connect=10.0)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    queue: list[Line] = []
    inflight: dict[Future, Line] = {}
    checked = 0.0
    with (
        httpx.Client(
            base_url=settings.TOLLGATE_INTERNAL_URL, headers=headers, timeout=timeout, limits=limits
        ) as client,
        ThreadPoolExecutor(concurrency, "batch") as pool,
    ):
        while True:
            if time.monotonic() - checked >= RENEW_EVERY_SECONDS:
                _check(run)
                checked = time.monotonic()
            while not run.stop.is_set() and len(inflight) < concurrency:
                if not queue:
                    queue = _next_lines(run)
                    if not queue:
                        break
                line = queue.pop(0)
                inflight[pool.submit(send, client, run, line)] = line
            if not inflight:
                return
            done, _ = wait(inflight, timeout=RENEW_EVERY_SECONDS, return_when=FIRST_COMPLETED)
            for future in done:
                line = inflight.pop(future)
                result = future.result()
                if result is not None and not run.lost:
                    services.record_result(run.batch.pk, line.pk, result)


def send(client: httpx.Client, run: Run, line: Line) -> dict | None:
    """The result line for one request, retrying what waiting can fix; None when told to stop."""
    max_attempts, attempt = settings.TOLLGATE_BATCH_MAX_ATTEMPTS, 0
    while True:
        try:
            answer = client.post(run.batch.endpoint, content=orjson.dumps(line.body))
        except httpx.HTTPError as exc:
            attempt += 1
            delay, result = (
                _backoff(attempt),
                services.result_line(
                    line.custom_id,
                    error={
                        "code": "request_failed",
                        "message": (
                            f"Tollgate could not complete the request: {exc.__class__.__name__}."
                        ),
                    },
                ),
            )
        else:
            result = _answered(line, answer)
            if (
                answer.status_code == 401
                and time.monotonic() - run.key_issued < KEY_PROPAGATION_SECONDS
            ):
                delay = 0.25  # the gateway has not learnt the new key yet; not an attempt
            else:
                attempt += 1
                delay = _retry_delay(answer, attempt)
                if delay is None:
                    return result
        if attempt >= max_attempts or run.stop.wait(delay):
            break
    return None if run.stop.is_set() else result


def _answered(line: Line, answer: httpx.Response) -> dict:
    try:
        body = answer.json()
    except ValueError:
        body = {
            "error": {
                "message": answer.text[:1000],
                "type": "server_error",
                "param": None,
                "code": None,
            }
        }
    response = {
        "status_code": answer.status_code,
        "request_id": answer.headers.get("x-request-id", ""),
        "body": body,
    }
    return services.result_line(line.custom_id, response=response)


def _retry_delay(answer: httpx.Response, attempt: int) -> float | None:
    """Seconds to wait before retrying this answer, or None when it is final."""
    status = answer.status_code
    if status in (502, 503) or (status == 429 and "retry-after" in answer.headers):
        try:
            wait_s = float(answer.headers.get("retry-after-ms", "")) / 1000
        except ValueError:
            try:
                wait_s = float(answer.headers.get("retry-after", ""))
            except ValueError:
                wait_s = _backoff(attempt)
        return min(max(wait_s, 0.05), settings.TOLLGATE_BATCH_MAX_RETRY_AFTER)
    return None


def _backoff(attempt: int) -> float:
    return min(0.5 * 2 ** (attempt - 1), settings.TOLLGATE_BATCH_MAX_RETRY_AFTER)


def recover() -> list[int]:
    """Batches no runner holds (a lost task, a killed worker): queue them again."""
    stale = list(services.stale_batches().values_list("pk", flat=True))
    for pk in stale:
        services.queue_run(pk)
    return stale
