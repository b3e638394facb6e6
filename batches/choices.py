"""State names of files and batches, as OpenAI spells them."""

from django.db import models


class Purpose(models.TextChoices):
    BATCH = "batch"
    BATCH_OUTPUT = "batch_output"


class Status(models.TextChoices):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


class LineState(models.TextChoices):
    PENDING = "pending"
    SUCCEEDED = "succeeded"  # a 2xx answer: goes to the output file
    FAILED = "failed"  # any other answer or a transport error: goes to the error file


# Work a runner may hold (under a lease); anything else is settled for good.
ACTIVE = (Status.VALIDATING, Status.IN_PROGRESS, Status.FINALIZING, Status.CANCELLING)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
COMPLETION_WINDOWS = {"24h": 24 * 3600}
