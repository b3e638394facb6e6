"""Sending webhook deliveries: one signed POST per attempt, retried with back-off.

An attempt is claimed with compare-and-set (its ``next_attempt_at`` is pushed one lease
ahead and its attempt counted), so the task queued for it and beat's pass over due
deliveries never send the same attempt twice; a worker killed mid-attempt leaves the
delivery due again once the lease ends. Every attempt is signed afresh (a new timestamp)
under the same delivery id, which receivers use to drop a delivery they already handled.
"""

import json
import logging
import time
from datetime import timedelta

import httpx
from django.conf import settings
from django.db.models import F
from django.utils import timezone

from alerts import signing
from alerts.choices import DeliveryStatus, Event
from alerts.models import WebhookDelivery
from core.tasks import enqueue as enqueue_task

log = logging.getLogger(__name__)

TASK = "alerts.deliver_webhook"
LEASE = timedelta(seconds=60)  # longer than one attempt can take (the timeout is seconds)
EXCERPT_CHARS = 1024  # of the receiver's answer, kept in the delivery log
ERROR_CHARS = 500
USER_AGENT = "Tollgate-Webhooks/1"
# Retries further away than this wait for beat's pass over due deliveries instead of a
# Celery countdown (a message held for hours outlives the broker's visibility timeout).
COUNTDOWN_MAX_SECONDS = 600
_RETRYABLE = (DeliveryStatus.PENDING, DeliveryStatus.FAILED)


def schedule() -> list[int]:
    """Seconds to wait after the 1st, 2nd, … failed attempt; after the last, give up."""
    return list(settings.TOLLGATE_WEBHOOK_RETRY_SCHEDULE)


def max_attempts() -> int:
    return 1 + len(schedule())


def body_of(row: WebhookDelivery) -> bytes:
    """The exact bytes sent (and signed): the stored payload as compact, key-sorted JSON."""
    return json.dumps(row.payload, sort_keys=True, separators=(",", ":")).encode()


def headers_for(row: WebhookDelivery, secret: str, timestamp: int, body: bytes) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        signing.EVENT_HEADER: row.event,
        signing.DELIVERY_HEADER: str(row.pk),
        signing.TIMESTAMP_HEADER: str(timestamp),
        signing.SIGNATURE_HEADER: signing.signature_header(secret, timestamp, body),
    }


def enqueue(delivery_id: object, countdown: float = 0) -> None:
    """Queue an attempt; if the broker cannot take it, beat's pass sends it when due."""
    try:
        options = {"countdown": countdown} if countdown else {}
        enqueue_task(TASK, str(delivery_id), queue=settings.CELERY_TASK_DEFAULT_QUEUE, **options)
    except Exception as exc:  # noqa: BLE001 - any broker error: the beat pass is the net
        log.warning("webhook delivery %s not queued (%s); beat will send it", delivery_id, exc)


def _claim(delivery_id: object) -> WebhookDelivery | None:
    now = timezone.now()
    claimed = WebhookDelivery.objects.filter(
        pk=delivery_id, status__in=_RETRYABLE, next_attempt_at__lte=now
    ).update(next_attempt_at=now + LEASE, attempts=F("attempts") + 1, last_attempt_at=now)
    if not claimed:
        return None  # not due, done, or another worker has this attempt
    return WebhookDelivery.objects.select_related("endpoint").get(pk=delivery_id)


def _post(row: WebhookDelivery) -> tuple[int | None, str, str]:
    """One signed POST: (status code or None, excerpt of the answer, error text)."""
    body = body_of(row)
    timestamp = int(timezone.now().timestamp())
    headers = headers_for(row, row.endpoint.secret, timestamp, body)
    timeout = settings.TOLLGATE_WEBHOOK_TIMEOUT
    try:
        with (
            httpx.Client(timeout=timeout, follow_redirects=False) as client,
            client.stream("POST", row.endpoint.url, content=body, headers=headers) as response,
        ):
            excerpt = _excerpt(response)
            code = response.status_code
    except httpx.HTTPError as exc:
        return None, "", f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
    if 200 <= code < 300:
        return code, excerpt, ""
    if response.is_redirect:
        return code, excerpt, "The receiver answered with a redirect; redirects are not followed."
    return code, excerpt, f"The receiver answered HTTP {code}."


def _excerpt(response: httpx.Response) -> str:
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size >= EXCERPT_CHARS * 4:  # enough bytes for EXCERPT_CHARS characters
            break
    return b"".join(chunks).decode("utf-8", "replace")[:EXCERPT_CHARS]


def attempt(delivery_id: object) -> WebhookDelivery | None:
    """Make the delivery's due attempt and record it; None when it was not due (sent,
    given up, waiting for its next attempt, or being sent by another worker)."""
    row = _claim(delivery_id)
    if row is None:
        return None
    if not row.endpoint.enabled and row.event != Event.TEST:
        return _finish(row, DeliveryStatus.GAVE_UP, None, "", "The endpoint is disabled.")
    code, excerpt, error = _post(row)
    if not error:
        return _finish(row, DeliveryStatus.SUCCEEDED, code, excerpt, "")
    if row.attempts >= max_attempts():
        log.warning("webhook delivery %s gave up after %d attempts", row.pk, row.attempts)
        return _finish(row, DeliveryStatus.GAVE_UP, code, excerpt, error)
    wait = schedule()[min(row.attempts, len(schedule())) - 1]
    _finish(row, DeliveryStatus.FAILED, code, excerpt, error, retry_in=wait)
    if wait <= COUNTDOWN_MAX_SECONDS:
        enqueue(row.pk, countdown=wait)
    return row


def _finish(
    row: WebhookDelivery,
    status: str,
    code: int | None,
    excerpt: str,
    error: str,
    retry_in: int | None = None,
) -> WebhookDelivery:
    next_at = timezone.now() + timedelta(seconds=retry_in) if retry_in is not None else None
    WebhookDelivery.objects.filter(pk=row.pk).update(
        status=status,
        response_code=code,
        response_excerpt=excerpt,
        error=error,
        next_attempt_at=next_at,
        updated_at=timezone.now(),
    )
    row.refresh_from_db()
    return row


def due_ids(limit: int = 200) -> list:
    """Deliveries whose next attempt is due (new ones, retries, attempts a dead worker left)."""
    rows = WebhookDelivery.objects.filter(
        status__in=_RETRYABLE, next_attempt_at__lte=timezone.now()
    ).order_by("next_attempt_at")
    return list(rows.values_list("pk", flat=True)[:limit])


def deliver_due(seconds: float = 20.0, limit: int = 200) -> int:
    """Attempt due deliveries in this process for up to about ``seconds`` (beat's pass);
    returns how many attempts were made. What is left waits for the next pass."""
    deadline = time.monotonic() + seconds
    made = 0
    for pk in due_ids(limit):
        if time.monotonic() > deadline:
            break
        made += attempt(pk) is not None
    return made
