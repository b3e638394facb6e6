"""Versioned prices, one usage event per request, and hourly rollups."""

from decimal import Decimal

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

from metering.choices import Endpoint, UsageStatus
from tenants.models import currency_validator

MONEY = {"max_digits": 18, "decimal_places": 9}
UNIT_PRICE = {
    "max_digits": 14,
    "decimal_places": 6,
    "validators": [MinValueValidator(Decimal("0"))],
}


class Price(models.Model):
    """One version of a model's price per 1M tokens, in force from ``effective_from``.

    Rows are never edited: a new price is a new row, so history stays as billed.
    """

    model = models.ForeignKey(
        "deployments.CatalogModel", on_delete=models.CASCADE, related_name="prices"
    )
    currency = models.CharField(max_length=3, default="USD", validators=[currency_validator])
    input_per_mtok = models.DecimalField(**UNIT_PRICE)
    cached_input_per_mtok = models.DecimalField(**UNIT_PRICE)
    output_per_mtok = models.DecimalField(**UNIT_PRICE)
    effective_from = models.DateTimeField(default=timezone.now)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model__served_name", "currency", "-effective_from"]
        constraints = [
            models.UniqueConstraint(
                fields=["model", "currency", "effective_from"], name="price_unique_version"
            )
        ]

    def __str__(self) -> str:
        return f"{self.model} {self.currency} from {self.effective_from:%Y-%m-%d %H:%M}"

    def cost(self, prompt: int, cached: int, completion: int) -> Decimal:
        """Exact decimal cost of a request; cached prompt tokens are billed at the cached rate."""
        uncached = max(prompt - cached, 0)
        total = (
            uncached * self.input_per_mtok
            + cached * self.cached_input_per_mtok
            + completion * self.output_per_mtok
        )
        return total / Decimal(1_000_000)


class UsageEvent(models.Model):
    """One request through the gateway: its tokens, outcome, timing and priced cost."""

    request_id = models.CharField(max_length=64, unique=True)
    occurred_at = models.DateTimeField(db_index=True)
    tenant = models.ForeignKey(
        "tenants.Tenant", on_delete=models.PROTECT, related_name="usage_events"
    )
    api_key = models.ForeignKey(
        "tenants.ApiKey",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="usage_events",
    )
    model = models.ForeignKey(
        "deployments.CatalogModel", on_delete=models.PROTECT, related_name="usage_events"
    )
    deployment = models.ForeignKey(
        "deployments.Deployment", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    endpoint = models.CharField(max_length=16, choices=Endpoint, default=Endpoint.CHAT)
    priority = models.CharField(max_length=2, blank=True)
    prompt_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    reasoning_tokens = models.PositiveIntegerField(default=0)
    status = models.CharField(max_length=16, choices=UsageStatus, default=UsageStatus.OK)
    http_status = models.PositiveSmallIntegerField(default=200)
    latency_ms = models.PositiveIntegerField(default=0)
    ttft_ms = models.PositiveIntegerField(null=True, blank=True)
    price = models.ForeignKey(
        Price, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    currency = models.CharField(max_length=3, default="USD")
    input_per_mtok = models.DecimalField(**UNIT_PRICE, default=Decimal(0))
    cached_input_per_mtok = models.DecimalField(**UNIT_PRICE, default=Decimal(0))
    output_per_mtok = models.DecimalField(**UNIT_PRICE, default=Decimal(0))
    cost = models.DecimalField(**MONEY, default=Decimal(0))
    ingested_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-occurred_at", "-id"]
        indexes = [models.Index(fields=["tenant", "occurred_at"])]

    def __str__(self) -> str:
        return self.request_id

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class UsageRollup(models.Model):
    """Usage summed per hour, tenant, key, model and deployment; rebuildable from events."""

    hour = models.DateTimeField()
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    api_key = models.ForeignKey(
        "tenants.ApiKey", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    model = models.ForeignKey(
        "deployments.CatalogModel", on_delete=models.CASCADE, related_name="+"
    )
    deployment = models.ForeignKey(
        "deployments.Deployment", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    currency = models.CharField(max_length=3, default="USD")
    requests = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    reasoning_tokens = models.PositiveBigIntegerField(default=0)
    cost = models.DecimalField(**MONEY, default=Decimal(0))

    class Meta:
        ordering = ["-hour"]
        constraints = [
            models.UniqueConstraint(
                fields=["hour", "tenant", "api_key", "model", "deployment", "currency"],
                name="rollup_unique_bucket",
                nulls_distinct=False,
            )
        ]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H:00} {self.tenant_id}/{self.model_id}"
