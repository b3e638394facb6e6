"""Console notices, webhook endpoints and their deliveries."""

import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone

from alerts.choices import DeliveryStatus, Event, Severity
from core.fields import EncryptedTextField

# What an admin sets on an endpoint (the admin API's serializer and the console's form write
# these fields; the audit log records them, the secret only as set or changed).
ENDPOINT_FIELDS = ("tenant", "url", "description", "events", "enabled")


class Notice(models.Model):
    """One alert as the console shows it: to platform admins (no tenant) or to a tenant's
    admins, as a banner until someone acknowledges it."""

    tenant = models.ForeignKey(
        "tenants.Tenant", null=True, blank=True, on_delete=models.CASCADE, related_name="notices"
    )
    event = models.CharField(max_length=64, choices=Event)
    severity = models.CharField(max_length=16, choices=Severity, default=Severity.WARNING)
    title = models.CharField(max_length=200)
    detail = models.TextField(blank=True)
    payload = models.JSONField(default=dict, blank=True)
    # Raising an alert again with the same key is a no-op: "fire once" is this constraint.
    dedupe_key = models.CharField(max_length=200, null=True, blank=True, unique=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    acknowledged_at = models.DateTimeField(null=True, blank=True)
    acknowledged_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "acknowledged_at"])]

    def __str__(self) -> str:
        return self.title

    @property
    def acknowledged(self) -> bool:
        return self.acknowledged_at is not None


class WebhookEndpoint(models.Model):
    """A URL Tollgate POSTs signed alert events to: a tenant's (its own events) or the
    platform's (no tenant: platform events, and every tenant's if subscribed)."""

    tenant = models.ForeignKey(
        "tenants.Tenant",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="webhook_endpoints",
    )
    url = models.URLField(max_length=2000)
    description = models.CharField(max_length=200, blank=True)
    events = models.JSONField(default=list)
    # Signing needs the secret itself (a hash cannot sign): encrypted at rest like external
    # engines' upstream keys, shown once when made or rotated.
    secret = EncryptedTextField()
    secret_rotated_at = models.DateTimeField(default=timezone.now)
    enabled = models.BooleanField(default=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return self.description or self.url[:200]

    @property
    def secret_hint(self) -> str:
        """The secret's first characters, to tell which one a receiver holds."""
        return f"{self.secret[:10]}…" if self.secret else ""


class WebhookDelivery(models.Model):
    """One event sent (or to be sent) to one endpoint: every attempt's outcome, and the
    next attempt's time while it is retried."""

    # Sent as Tollgate-Delivery and in the body: the same on every retry, so receivers can
    # drop a delivery they already handled.
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    endpoint = models.ForeignKey(
        WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries"
    )
    notice = models.ForeignKey(
        Notice, null=True, blank=True, on_delete=models.SET_NULL, related_name="deliveries"
    )
    event = models.CharField(max_length=64, choices=Event)
    # The JSON body's content, signed and sent as is on every attempt.
    payload = models.JSONField(default=dict)
    status = models.CharField(
        max_length=16, choices=DeliveryStatus, default=DeliveryStatus.PENDING, db_index=True
    )
    attempts = models.PositiveSmallIntegerField(default=0)
    response_code = models.PositiveSmallIntegerField(null=True, blank=True)
    response_excerpt = models.TextField(blank=True)
    error = models.TextField(blank=True)
    next_attempt_at = models.DateTimeField(null=True, blank=True, db_index=True)
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.event} to {self.endpoint_id} ({self.status})"
