"""Versioned prices, one usage event per request, hourly rollups, closed periods and
adjustments, quota reconciliation results and dead letters."""

from decimal import Decimal

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

from core.pricing import Rates, cost_nano, from_nano
from metering.choices import Endpoint, UsageStatus
from tenants.models import currency_validator

MONEY = {"max_digits": 18, "decimal_places": 9}
UNIT_PRICE = {
    "max_digits": 14,
    "decimal_places": 6,
    "validators": [MinValueValidator(Decimal("0"))],
}


# What an admin sets on a price (the admin API's serializer writes these fields, the audit
# log records them; tenants.models says more).
PRICE_FIELDS = (
    "model",
    "adapter",
    "currency",
    "input_per_mtok",
    "cached_input_per_mtok",
    "output_per_mtok",
    "effective_from",
)


class Price(models.Model):
    """One version of a model's (or one of its adapters') price per 1M tokens, in force
    from ``effective_from``.

    Rows are never edited: a new price is a new row, so history stays as billed. A row with
    ``adapter`` set prices that LoRA adapter (``model`` is its base); an adapter without
    prices of its own is billed at its base's.
    """

    model = models.ForeignKey(
        "deployments.CatalogModel", on_delete=models.CASCADE, related_name="prices"
    )
    # Cascading cannot lose history: events and rollups PROTECT the prices they were billed
    # at (and the adapter itself), so only versions nothing was billed at go with an adapter.
    adapter = models.ForeignKey(
        "deployments.Adapter",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="prices",
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
        ordering = ["model__served_name", "adapter__served_name", "currency", "-effective_from"]
        constraints = [
            # The base's versions and each adapter's are separate histories.
            models.UniqueConstraint(
                fields=["model", "adapter", "currency", "effective_from"],
                name="price_unique_version",
                nulls_distinct=False,
            )
        ]

    def __str__(self) -> str:
        what = self.adapter if self.adapter_id else self.model
        return f"{what} {self.currency} from {self.effective_from:%Y-%m-%d %H:%M}"

    @property
    def rates(self) -> Rates:
        return Rates.of(self.input_per_mtok, self.cached_input_per_mtok, self.output_per_mtok)

    def cost(self, prompt: int, cached: int, completion: int) -> Decimal:
        """What a request is billed at this price (``core.pricing.cost_nano``), nine places."""
        return from_nano(cost_nano(self.rates, prompt, cached, completion))


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
    # The LoRA adapter called (``model`` is then its base); empty: the base model itself.
    adapter = models.ForeignKey(
        "deployments.Adapter",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="usage_events",
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
    # No engine counted the prompt (it went away): prompt_tokens is the gateway's estimate.
    prompt_estimated = models.BooleanField(default=False)
    status = models.CharField(max_length=16, choices=UsageStatus, default=UsageStatus.OK)
    http_status = models.PositiveSmallIntegerField(default=200)
    latency_ms = models.PositiveIntegerField(default=0)
    ttft_ms = models.PositiveIntegerField(null=True, blank=True)
    # How long the request waited for its on-demand model to start (empty: it did not wait).
    start_wait_ms = models.PositiveIntegerField(null=True, blank=True)
    # The engine replica that served it (a deployments.Replica id, kept after the replica is
    # gone): the bill is checked against that engine's own counters (metering/engine_ledger.py).
    replica_id = models.PositiveIntegerField(null=True, blank=True)
    # Times the gateway preempted it and resumed it later (the engine's redone work is the
    # operator's cost, not billed).
    preemptions = models.PositiveIntegerField(default=0)
    price = models.ForeignKey(
        Price, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    currency = models.CharField(max_length=3, default="USD")
    input_per_mtok = models.DecimalField(**UNIT_PRICE, default=Decimal(0))
    cached_input_per_mtok = models.DecimalField(**UNIT_PRICE, default=Decimal(0))
    output_per_mtok = models.DecimalField(**UNIT_PRICE, default=Decimal(0))
    cost = models.DecimalField(**MONEY, default=Decimal(0))
    ingested_at = models.DateTimeField(auto_now_add=True)
    # Where the event sat in the Redis stream (ms-seq of its id): quota reconciliation
    # tells events the gateway had counted at a snapshot from those that came after it.
    stream_ms = models.BigIntegerField(null=True, blank=True)
    stream_seq = models.BigIntegerField(null=True, blank=True)
    # Set when the event arrived after its period was closed: the hour (in the first open
    # period) its adjustment line was booked into. Its own hour's rollup stays frozen.
    adjustment_hour = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-occurred_at", "-id"]
        indexes = [
            models.Index(fields=["tenant", "occurred_at"]),
            models.Index(fields=["stream_ms"], name="usage_stream_ms_idx"),
            models.Index(
                fields=["replica_id", "stream_ms", "stream_seq"], name="usage_replica_stream_idx"
            ),
        ]

    def __str__(self) -> str:
        return self.request_id

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def unpriced(self) -> bool:
        """No price was in force for the model (or adapter) and currency: stored at cost 0."""
        return self.price_id is None


class UsageRollup(models.Model):
    """Usage summed per hour, tenant, key, model, adapter and deployment; rebuildable from
    events."""

    hour = models.DateTimeField()
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    api_key = models.ForeignKey(
        "tenants.ApiKey", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    model = models.ForeignKey(
        "deployments.CatalogModel", on_delete=models.CASCADE, related_name="+"
    )
    adapter = models.ForeignKey(
        "deployments.Adapter", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    deployment = models.ForeignKey(
        "deployments.Deployment", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # The price version the bucket's events were billed at (None: unpriced), so a price
    # change mid-hour gives two buckets with their own unit prices.
    price = models.ForeignKey(
        Price, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    currency = models.CharField(max_length=3, default="USD")
    requests = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    reasoning_tokens = models.PositiveBigIntegerField(default=0)
    # The part of prompt_tokens that is an estimate (UsageEvent.prompt_estimated).
    estimated_prompt_tokens = models.PositiveBigIntegerField(default=0)
    cost = models.DecimalField(**MONEY, default=Decimal(0))

    class Meta:
        ordering = ["-hour"]
        constraints = [
            models.UniqueConstraint(
                fields=[
                    "hour",
                    "tenant",
                    "api_key",
                    "model",
                    "adapter",
                    "deployment",
                    "price",
                    "currency",
                ],
                name="rollup_unique_bucket_priced",
                nulls_distinct=False,
            )
        ]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H:00} {self.tenant_id}/{self.model_id}"


class UsageAdjustment(models.Model):
    """Usage that arrived after its period was closed, booked into an hour of an open period.

    ``hour`` is the booking hour (in the first open period), ``usage_hour`` the hour the
    requests happened. Closed periods' rollups and exports never change.
    """

    hour = models.DateTimeField()
    usage_hour = models.DateTimeField()
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    api_key = models.ForeignKey(
        "tenants.ApiKey", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    model = models.ForeignKey(
        "deployments.CatalogModel", on_delete=models.CASCADE, related_name="+"
    )
    adapter = models.ForeignKey(
        "deployments.Adapter", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    deployment = models.ForeignKey(
        "deployments.Deployment", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    price = models.ForeignKey(
        Price, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    currency = models.CharField(max_length=3, default="USD")
    requests = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    reasoning_tokens = models.PositiveBigIntegerField(default=0)
    # The part of prompt_tokens that is an estimate (UsageEvent.prompt_estimated).
    estimated_prompt_tokens = models.PositiveBigIntegerField(default=0)
    cost = models.DecimalField(**MONEY, default=Decimal(0))

    class Meta:
        ordering = ["-hour"]
        constraints = [
            models.UniqueConstraint(
                fields=[
                    "hour",
                    "usage_hour",
                    "tenant",
                    "api_key",
                    "model",
                    "adapter",
                    "deployment",
                    "price",
                    "currency",
                ],
                name="adjustment_unique_bucket",
                nulls_distinct=False,
            )
        ]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H:00} adj. {self.usage_hour:%Y-%m-%d %H:00} {self.tenant_id}"


class ClosedPeriod(models.Model):
    """A closed billing period (a UTC calendar month): its figures are frozen for good.

    Periods close in order; everything before the latest ``end`` is frozen.
    """

    start = models.DateTimeField(unique=True)
    end = models.DateTimeField()
    closed_at = models.DateTimeField(default=timezone.now)
    closed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Totals at close per currency, {"USD": {"requests": n, "tokens": n, "cost": "1.23"}}.
    totals = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-start"]

    def __str__(self) -> str:
        return f"{self.start:%Y-%m}"


class QuotaReconciliation(models.Model):
    """The last reconciliation of one tenant's Redis quota counters for one period."""

    class Status(models.TextChoices):
        OK = "ok", "In agreement"
        CORRECTED = "corrected", "Drift corrected"
        SKIPPED_BACKLOG = "skipped_backlog", "Skipped: usage backlog too large"

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    period_id = models.CharField(max_length=16)
    checked_at = models.DateTimeField(default=timezone.now)
    status = models.CharField(max_length=16, choices=Status)
    tokens_redis = models.BigIntegerField(default=0)
    tokens_db = models.BigIntegerField(default=0)
    money_redis = models.DecimalField(**MONEY, default=Decimal(0))
    money_db = models.DecimalField(**MONEY, default=Decimal(0))
    backlog_events = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-checked_at"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "period_id"], name="reconcile_unique_period")
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.period_id} {self.status}"

    @property
    def tokens_drift(self) -> int:
        """What Redis counted beyond the database (negative: under-counted)."""
        return self.tokens_redis - self.tokens_db

    @property
    def money_drift(self) -> Decimal:
        return self.money_redis - self.money_db


class DeadLetter(models.Model):
    """A usage stream entry that could not be stored, kept with the reason; it was acked."""

    stream_id = models.CharField(max_length=48, unique=True)
    payload = models.TextField()
    reason = models.TextField()
    received_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-received_at", "-id"]

    def __str__(self) -> str:
        return f"{self.stream_id}: {self.reason[:60]}"


class EngineLedger(models.Model):
    """One replica's hour: its engine's own token counters against the tokens Tollgate
    billed for the requests it served, summed over the stretches checked in that hour
    (metering/engine_ledger.py)."""

    # A deployments.Replica id: the row outlives the replica, its deployment's name is kept.
    replica_id = models.PositiveIntegerField()
    deployment = models.ForeignKey(
        "deployments.Deployment", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    deployment_name = models.CharField(max_length=100)
    replica_index = models.PositiveSmallIntegerField(default=0)
    hour = models.DateTimeField()
    # Stretches between two quiet moments of the engine, compared token by token.
    checks = models.PositiveIntegerField(default=0)
    requests = models.PositiveIntegerField(default=0)
    engine_prompt = models.BigIntegerField(default=0)
    engine_cached = models.BigIntegerField(default=0)
    engine_generation = models.BigIntegerField(default=0)
    billed_prompt = models.BigIntegerField(default=0)
    billed_cached = models.BigIntegerField(default=0)
    billed_generation = models.BigIntegerField(default=0)
    # Tollgate's own requests to the engine (its check whether the engine aborts requests).
    own_prompt = models.BigIntegerField(default=0)
    own_cached = models.BigIntegerField(default=0)
    own_generation = models.BigIntegerField(default=0)
    # Requests Tollgate closed early (the client left, a preemption), and the tokens the
    # engine made for them after that, never delivered so never billed (within the allowance).
    cut_requests = models.PositiveIntegerField(default=0)
    undelivered_generation = models.BigIntegerField(default=0)
    # Engine minus bill beyond every allowance (negative: billed more than the engine did).
    drift_prompt = models.BigIntegerField(default=0)
    drift_cached = models.BigIntegerField(default=0)
    drift_generation = models.BigIntegerField(default=0)
    drift_checks = models.PositiveIntegerField(default=0)
    # Stretches that could not be compared: the engine restarted (its counters began again),
    # or Tollgate's own check request overlapped other traffic. Their billed tokens are kept.
    restarts = models.PositiveIntegerField(default=0)
    inexact_checks = models.PositiveIntegerField(default=0)
    unverified_prompt = models.BigIntegerField(default=0)
    unverified_generation = models.BigIntegerField(default=0)
    last_checked_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-hour", "deployment_name", "replica_index"]
        constraints = [
            models.UniqueConstraint(fields=["replica_id", "hour"], name="engine_ledger_unique_hour")
        ]
        indexes = [models.Index(fields=["deployment", "hour"])]

    def __str__(self) -> str:
        return f"{self.deployment_name}#{self.replica_index} {self.hour:%Y-%m-%d %H:00}"

    @property
    def drift(self) -> int:
        """Tokens the bill and the engine disagree on beyond the allowances, all kinds."""
        return abs(self.drift_prompt) + abs(self.drift_cached) + abs(self.drift_generation)
