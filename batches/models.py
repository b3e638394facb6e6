"""Files uploaded through ``/v1/files`` and batches run from them (OpenAI's Batch API)."""

import secrets

from django.db import models
from django.utils import timezone

from batches.choices import LineState, Purpose, Status
from tenants.models import ApiKey, Tenant


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


class File(models.Model):
    """A tenant's file: a batch input, or a batch's output or error file, bytes in PostgreSQL."""

    public_id = models.CharField(max_length=40, unique=True, default=new_file_id)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="files")
    api_key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    filename = models.CharField(max_length=255)
    purpose = models.CharField(max_length=20, choices=Purpose.choices)
    size = models.PositiveBigIntegerField()
    lines = models.PositiveIntegerField(default=0)
    content = models.BinaryField()
    # Set by the service with the same clock reading as expires_at, so a window is exact.
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-pk"]
        indexes = [models.Index(fields=["tenant", "-id"]), models.Index(fields=["expires_at"])]

    def __str__(self) -> str:
        return self.public_id


class Batch(models.Model):
    """One batch job: its requests run as P2 through the gateway with a child of ``api_key``."""

    public_id = models.CharField(max_length=40, unique=True, default=new_batch_id)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="batches")
    api_key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="batches")
    input_file_id = models.CharField(max_length=40)
    endpoint = models.CharField(max_length=40)
    completion_window = models.CharField(max_length=8, default="24h")
    model = models.CharField(max_length=200, blank=True)
    metadata = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.VALIDATING)
    errors = models.JSONField(null=True, blank=True)
    output_file_id = models.CharField(max_length=40, blank=True)
    error_file_id = models.CharField(max_length=40, blank=True)

    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    input_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    output_tokens = models.PositiveBigIntegerField(default=0)
    reasoning_tokens = models.PositiveBigIntegerField(default=0)

    # Set by the service with the same clock reading as expires_at, so a window is exact.
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    # The runner holding the batch renews its lease; an expired lease lets another take over.
    lease_owner = models.CharField(max_length=32, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-pk"]
        indexes = [
            models.Index(fields=["tenant", "-id"]),
            models.Index(fields=["status", "lease_until"]),
        ]

    def __str__(self) -> str:
        return self.public_id


class BatchLine(models.Model):
    """One request of a batch (copied from the input file) and, once answered, its result line."""

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines")
    line = models.PositiveIntegerField()  # 1-based line number in the input file
    custom_id = models.CharField(max_length=512)
    body = models.JSONField()
    state = models.CharField(max_length=10, choices=LineState.choices, default=LineState.PENDING)
    result = models.JSONField(null=True, blank=True)  # the output/error file line, OpenAI's shape

    class Meta:
        ordering = ["batch", "line"]
        constraints = [models.UniqueConstraint(fields=["batch", "line"], name="batch_line_unique")]
        indexes = [models.Index(fields=["batch", "state"])]

    def __str__(self) -> str:
        return f"{self.batch_id}:{self.line}"
