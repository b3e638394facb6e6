"""Rules for alerts: raising one (a console notice, a log line, webhook deliveries), the
webhook endpoints admins manage, and who sees which notices, endpoints and deliveries.

Any part of Tollgate raises an alert with ``raise_alert``; the events and their payloads
are listed in ``alerts.choices`` and docs/admins/alerts.md.
"""

import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from django.core.exceptions import ValidationError
from django.core.serializers.json import DjangoJSONEncoder
from django.db import IntegrityError, transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from alerts import delivery
from alerts.choices import SUBSCRIBABLE, TENANT_SUBSCRIBABLE, DeliveryStatus, Event, Severity
from alerts.models import ENDPOINT_FIELDS, Notice, WebhookDelivery, WebhookEndpoint
from tenants.access import admin_tenant_ids
from tenants.audit import Actor, diff, record, snapshot
from tenants.choices import AuditAction
from tenants.models import Tenant

log = logging.getLogger(__name__)

SECRET_PREFIX = "whsec_"
_LOG_LEVELS = {
    Severity.INFO: logging.INFO,
    Severity.WARNING: logging.WARNING,
    Severity.CRITICAL: logging.ERROR,
}


# --- Raising alerts ------------------------------------------------------------------------


def raise_alert(
    event: str,
    *,
    title: str,
    detail: str,
    payload: dict,
    tenant: Tenant | None = None,
    severity: str = Severity.WARNING,
    dedupe_key: str | None = None,
) -> Notice | None:
    """Tell the people concerned: a console notice (platform admins' when ``tenant`` is
    None, else the tenant's admins'), one log line, and a signed webhook delivery to every
    enabled endpoint subscribed to ``event`` (the tenant's own endpoints and the platform's).

    With a ``dedupe_key`` the alert fires once: raising it again returns None and does
    nothing. ``payload`` must be JSON-serialisable (decimals and datetimes become strings).
    """
    if event not in Event.values:
        raise ValueError(f"unknown alert event {event!r} (alerts.choices.Event)")
    if severity not in Severity.values:
        raise ValueError(f"unknown severity {severity!r} (alerts.choices.Severity)")
    data = json.loads(json.dumps(payload, cls=DjangoJSONEncoder))
    try:
        with transaction.atomic():
            notice = Notice.objects.create(
                tenant=tenant,
                event=event,
                severity=severity,
                title=title[:200],
                detail=detail,
                payload=data,
                dedupe_key=dedupe_key,
            )
            deliveries = [
                _queue_delivery(endpoint, notice) for endpoint in _subscribers(event, tenant)
            ]
    except IntegrityError:
        if dedupe_key and Notice.objects.filter(dedupe_key=dedupe_key).exists():
            return None  # raised before: fire once
        raise
    where = f" tenant={tenant.slug}" if tenant else ""
    log.log(
        _LOG_LEVELS[severity],
        "alert %s%s: %s (%d webhook deliveries)",
        event,
        where,
        notice.title,
        len(deliveries),
    )
    return notice


def _subscribers(event: str, tenant: Tenant | None) -> QuerySet[WebhookEndpoint]:
    endpoints = WebhookEndpoint.objects.filter(enabled=True, events__contains=[event])
    if tenant is None:
        return endpoints.filter(tenant=None)
    return endpoints.filter(Q(tenant=tenant) | Q(tenant=None))


def envelope(notice: Notice) -> dict[str, Any]:
    """The body every endpoint receives for a notice (without the delivery's own id)."""
    tenant = notice.tenant
    return {
        "event": notice.event,
        "created_at": notice.created_at.isoformat(),
        "severity": notice.severity,
        "title": notice.title,
        "detail": notice.detail,
        "tenant": None
        if tenant is None
        else {"id": tenant.pk, "slug": tenant.slug, "name": tenant.name},
        "data": notice.payload,
    }


def _queue_delivery(endpoint: WebhookEndpoint, notice: Notice | None, body: dict | None = None):
    row = WebhookDelivery(endpoint=endpoint, notice=notice, next_attempt_at=timezone.now())
    content = body if body is not None else envelope(notice)
    row.event = content["event"]
    row.payload = {"id": str(row.pk), **content}
    row.save()
    transaction.on_commit(lambda: delivery.enqueue(row.pk))
    return row


# --- Webhook endpoints ---------------------------------------------------------------------


@dataclass(frozen=True)
class IssuedEndpoint:
    """An endpoint and its signing secret, which is shown only from this object."""

    endpoint: WebhookEndpoint
    secret: str


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def validate_url(url: str) -> str:
    """http or https, a host, no credentials. Internal addresses are allowed: the appliance
    is self-hosted and its admins choose where its alerts go."""
    url = (url or "").strip()
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValidationError({"url": f"This is not a valid URL: {exc}."}) from None
    if parts.scheme not in ("http", "https"):
        raise ValidationError({"url": "Use an http:// or https:// URL."})
    if not parts.hostname:
        raise ValidationError({"url": "The URL needs a host name or address."})
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise ValidationError(
            {
                "url": "Put no credentials in the URL: receivers check the Tollgate-Signature "
                "header instead."
            }
        )
    if port == 0:
        raise ValidationError({"url": "Port 0 is not a port to send to."})
    if len(url) > 2000:
        raise ValidationError({"url": "The URL is longer than 2,000 characters."})
    return url


def validate_events(events: Any, tenant: Tenant | None) -> list[str]:
    """The subscribed events, known and allowed for the endpoint's owner, in a stable order."""
    if not isinstance(events, list | tuple) or not all(isinstance(e, str) for e in events):
        raise ValidationError({"events": "Give a list of event names."})
    if not events:
        raise ValidationError({"events": "Subscribe to at least one event."})
    unknown = sorted(set(events) - set(SUBSCRIBABLE))
    if unknown:
        known = ", ".join(SUBSCRIBABLE)
        raise ValidationError({"events": f"Unknown event(s): {', '.join(unknown)}. Use {known}."})
    if tenant is not None:
        platform_only = sorted(set(events) - set(TENANT_SUBSCRIBABLE))
        if platform_only:
            raise ValidationError(
                {
                    "events": f"{', '.join(platform_only)}: platform events go to platform "
                    "endpoints only."
                }
            )
    return [e for e in SUBSCRIBABLE if e in events]


def create_endpoint(
    actor: Actor,
    tenant: Tenant | None,
    url: str,
    events: list[str],
    description: str = "",
    enabled: bool = True,
) -> IssuedEndpoint:
    """A new endpoint with a new signing secret (returned once, kept encrypted)."""
    secret = new_secret()
    user = actor if actor is not None and actor.is_authenticated else None
    endpoint = WebhookEndpoint(
        tenant=tenant,
        url=validate_url(url),
        events=validate_events(events, tenant),
        description=description,
        enabled=enabled,
        secret=secret,
        created_by=user,
    )
    endpoint.full_clean(exclude=["url"])  # validate_url is the rule (it allows internal hosts)
    endpoint.save()
    record(
        actor,
        AuditAction.CREATE,
        endpoint,
        tenant=tenant,
        changes=snapshot(endpoint, (*ENDPOINT_FIELDS, "secret")),
    )
    return IssuedEndpoint(endpoint=endpoint, secret=secret)


def update_endpoint(actor: Actor, endpoint: WebhookEndpoint, **changes: Any) -> WebhookEndpoint:
    """Change an endpoint's URL, description, events or whether it is enabled (its owner
    never changes)."""
    if "tenant" in changes and changes.pop("tenant") != endpoint.tenant:
        raise ValidationError({"tenant": "An endpoint's tenant cannot change."})
    before = snapshot(endpoint, ENDPOINT_FIELDS)
    if "url" in changes:
        changes["url"] = validate_url(changes["url"])
    if "events" in changes:
        changes["events"] = validate_events(changes["events"], endpoint.tenant)
    for name, value in changes.items():
        setattr(endpoint, name, value)
    endpoint.full_clean(exclude=["url"])
    endpoint.save()
    record(
        actor,
        AuditAction.UPDATE,
        endpoint,
        tenant=endpoint.tenant,
        changes=diff(before, snapshot(endpoint, ENDPOINT_FIELDS)),
    )
    return endpoint


def rotate_secret(actor: Actor, endpoint: WebhookEndpoint) -> IssuedEndpoint:
    """A new signing secret, in force at once (returned once); the old one signs no more."""
    secret = new_secret()
    now = timezone.now()
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(secret=secret, secret_rotated_at=now)
    endpoint.refresh_from_db()
    record(
        actor, AuditAction.ACTION, endpoint, tenant=endpoint.tenant, changes={"secret": "rotated"}
    )
    return IssuedEndpoint(endpoint=endpoint, secret=secret)


def delete_endpoint(actor: Actor, endpoint: WebhookEndpoint) -> None:
    """Delete an endpoint and its delivery log."""
    record(actor, AuditAction.DELETE, endpoint, tenant=endpoint.tenant)
    endpoint.delete()


@transaction.atomic
def send_test(actor: Actor, endpoint: WebhookEndpoint) -> WebhookDelivery:
    """Queue a ``test`` event to this endpoint only (enabled or not: it is how an admin
    checks a receiver before turning the endpoint on)."""
    tenant = endpoint.tenant
    who = actor.get_username() if actor is not None and actor.is_authenticated else "Tollgate"
    body = {
        "event": Event.TEST,
        "created_at": timezone.now().isoformat(),
        "severity": Severity.INFO,
        "title": "Test event from Tollgate",
        "detail": f"{who} sent a test event to check this endpoint's receiver.",
        "tenant": None
        if tenant is None
        else {"id": tenant.pk, "slug": tenant.slug, "name": tenant.name},
        "data": {"endpoint": {"id": endpoint.pk, "description": endpoint.description}},
    }
    return _queue_delivery(endpoint, None, body=body)


def retry_now(actor: Actor, row: WebhookDelivery) -> WebhookDelivery:
    """Attempt a failed (or given up) delivery again now; a given-up one gets one more."""
    retryable = (DeliveryStatus.FAILED, DeliveryStatus.GAVE_UP)
    updated = WebhookDelivery.objects.filter(pk=row.pk, status__in=retryable).update(
        status=DeliveryStatus.FAILED, next_attempt_at=timezone.now()
    )
    if not updated:
        state = WebhookDelivery.objects.get(pk=row.pk).get_status_display().lower()
        raise ValidationError(f"This delivery cannot be retried now: it is {state}.")
    transaction.on_commit(lambda: delivery.enqueue(row.pk))
    row.refresh_from_db()
    return row


# --- Notices ---------------------------------------------------------------------------


def acknowledge(actor: Actor, notice: Notice) -> Notice:
    """Mark a notice as seen (for everyone who sees it); its banner goes away."""
    user = actor if actor is not None and actor.is_authenticated else None
    Notice.objects.filter(pk=notice.pk, acknowledged_at__isnull=True).update(
        acknowledged_at=timezone.now(), acknowledged_by=user
    )
    notice.refresh_from_db()
    return notice


# --- Who sees what (tenant isolation as in tenants.access) --------------------------------


def may_manage(user: Any, tenant: Tenant | None) -> bool:
    """Who may change an endpoint (or retry its deliveries): platform endpoints, platform
    admins; a tenant's, its admins (and platform admins)."""
    return user.is_staff if tenant is None else user.is_staff or tenant.pk in admin_tenant_ids(user)


def notices_visible_to(user: Any) -> QuerySet[Notice]:
    """Platform admins see every notice; tenant admins their tenants'; members none."""
    notices = Notice.objects.select_related("tenant", "acknowledged_by")
    return notices if user.is_staff else notices.filter(tenant_id__in=admin_tenant_ids(user))


def banner_notices(user: Any) -> QuerySet[Notice]:
    """What the console's banner shows the user: unacknowledged platform notices to
    platform admins, their tenants' to tenant admins."""
    open_notices = Notice.objects.filter(acknowledged_at__isnull=True).select_related("tenant")
    if user.is_staff:
        return open_notices.filter(tenant=None)
    return open_notices.filter(tenant_id__in=admin_tenant_ids(user))


def endpoints_visible_to(user: Any) -> QuerySet[WebhookEndpoint]:
    """Platform admins see every endpoint; tenant admins their tenants'; members none."""
    endpoints = WebhookEndpoint.objects.select_related("tenant", "created_by")
    return endpoints if user.is_staff else endpoints.filter(tenant_id__in=admin_tenant_ids(user))


def deliveries_visible_to(user: Any) -> QuerySet[WebhookDelivery]:
    """Deliveries are seen with their endpoint."""
    rows = WebhookDelivery.objects.select_related("endpoint", "endpoint__tenant")
    if user.is_staff:
        return rows
    return rows.filter(endpoint__tenant_id__in=admin_tenant_ids(user))
