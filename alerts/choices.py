"""Names of alert events, severities and webhook delivery states: stated once, here.

The payload each event carries is documented in docs/admins/alerts.md.
"""

from django.db import models


class Event(models.TextChoices):
    """What happened. Webhook endpoints subscribe to events by these names."""

    BUDGET_THRESHOLD = "budget.threshold", "A budget threshold was crossed"
    ENGINE_DRIFT = "engine.drift", "Billed tokens drifted from the engine's counters"
    TEST = "test", "Test event (the endpoint's 'send test event' button)"


# What an endpoint may subscribe to: the test event is sent on request, to one endpoint.
SUBSCRIBABLE = (Event.BUDGET_THRESHOLD, Event.ENGINE_DRIFT)
# What a tenant's endpoint may subscribe to: its own tenant's events; the engine is the
# platform's business.
TENANT_SUBSCRIBABLE = (Event.BUDGET_THRESHOLD,)


class Severity(models.TextChoices):
    INFO = "info", "Info"
    WARNING = "warning", "Warning"
    CRITICAL = "critical", "Critical"


class DeliveryStatus(models.TextChoices):
    """pending: an attempt is due (or running); failed: the last attempt failed and another
    is scheduled at ``next_attempt_at``; gave_up: the last scheduled attempt failed."""

    PENDING = "pending", "Pending"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed, will retry"
    GAVE_UP = "gave_up", "Gave up"
