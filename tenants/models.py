"""Tenants, their members, inference API keys, admin API tokens and the audit log."""

from decimal import Decimal

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

from core.credentials import unexpired, usable_filter
from tenants.choices import AuditAction, ModelAccess, Priority, QuotaPeriod, Role, TenantStatus

currency_validator = RegexValidator(r"^[A-Z]{3}$", "Use a three-letter ISO 4217 code, e.g. USD.")

LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests")

# What an admin sets, one list per model: the admin API's serializers write these fields, the
# console's forms show them (or some of them), the services change them and the audit log
# records them (tenants.audit.snapshot). A field added to a serializer goes here too, or
# tests/api/test_audit_coverage.py fails.
TENANT_FIELDS = (
    "name",
    "slug",
    "priority",
    *LIMIT_FIELDS,
    "quota_period",
    "quota_tokens",
    "quota_amount",
    "currency",
    "alert_thresholds",
    "model_access",
    "allowed_models",
    "fair_share_weight",
)
BUDGET_FIELDS = ("budget_tokens", "budget_amount")
KEY_FIELDS = ("tenant", "name", "expires_at", *LIMIT_FIELDS, *BUDGET_FIELDS, "allowed_models")
MEMBERSHIP_FIELDS = ("tenant", "user", "role")
# Of Django's user model; the password is audited as set or changed, never by value.
USER_FIELDS = ("username", "email", "first_name", "last_name", "is_staff", "is_active")
TOKEN_FIELDS = ("name", "expires_at")

DEFAULT_ALERT_THRESHOLDS = (50, 80, 100)


def default_alert_thresholds() -> list[int]:
    return list(DEFAULT_ALERT_THRESHOLDS)


def validate_thresholds(value: list[int]) -> None:
    """Budget alert thresholds: whole percentages from 1 to 100, each once."""
    outside = sorted({t for t in value if not 1 <= t <= 100})
    if outside:
        raise ValidationError(
            f"Thresholds are percentages from 1 to 100; not {', '.join(map(str, outside))}."
        )
    if len(set(value)) != len(value):
        raise ValidationError("Give each threshold once.")


class Tenant(models.Model):
    """A customer of the appliance: its limits, quota, priority and model access."""

    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=64, unique=True)
    status = models.CharField(max_length=16, choices=TenantStatus, default=TenantStatus.ACTIVE)
    priority = models.CharField(max_length=2, choices=Priority, default=Priority.STANDARD)
    # Limits: None means unlimited.
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True, default=600)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True, default=1_000_000)
    max_concurrent_requests = models.PositiveIntegerField(null=True, blank=True, default=32)
    # Quota per period: None means no quota of that kind.
    quota_period = models.CharField(max_length=16, choices=QuotaPeriod, default=QuotaPeriod.MONTHLY)
    quota_tokens = models.PositiveBigIntegerField(null=True, blank=True)
    quota_amount = models.DecimalField(
        max_digits=14,
        decimal_places=4,
        null=True,
        blank=True,
        validators=[MinValueValidator(Decimal("0"))],
    )
    currency = models.CharField(max_length=3, default="USD", validators=[currency_validator])
    # Percentages of each quota (and of its keys' budgets) at which budget alerts fire, once
    # per period each (metering.budgets); empty: no budget alerts.
    alert_thresholds = ArrayField(
        models.PositiveSmallIntegerField(),
        default=default_alert_thresholds,
        blank=True,
        validators=[validate_thresholds],
        help_text="Percentages of each quota at which budget alerts fire, e.g. 50, 80, 100.",
    )
    # Admission: an admin may lift a tenant to P0 until a moment; its share inside a class.
    priority_boost_until = models.DateTimeField(null=True, blank=True)
    fair_share_weight = models.PositiveSmallIntegerField(
        default=1,
        validators=[MinValueValidator(1)],
        help_text="Relative share of a saturated model among tenants of the same class.",
    )
    model_access = models.CharField(max_length=8, choices=ModelAccess, default=ModelAccess.ALL)
    allowed_models = models.ManyToManyField(
        "deployments.CatalogModel", blank=True, related_name="listed_by_tenants"
    )
    # Tollgate's own tenant (slug "platform"): staff tests in the playground bill to it, and
    # showback leaves it out unless it is asked for by name.
    internal = models.BooleanField(default=False, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def is_active(self) -> bool:
        return self.status == TenantStatus.ACTIVE

    def clean(self) -> None:
        if self.alert_thresholds:
            self.alert_thresholds = sorted(self.alert_thresholds)

    @property
    def effective_priority(self) -> str:
        """The tenant's class now: P0 while an admin's boost lasts, else its own."""
        if self.priority_boost_until and self.priority_boost_until > timezone.now():
            return Priority.INTERACTIVE
        return self.priority


class Membership(models.Model):
    """A console user's role in one tenant."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant__name", "user__username"]
        constraints = [
            models.UniqueConstraint(fields=["user", "tenant"], name="membership_unique_user_tenant")
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} ({self.role})"


class Account(models.Model):
    """What Tollgate keeps about a console user beyond Django's user: how they sign in."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, primary_key=True, related_name="account"
    )
    # Set with every password someone else chose (the first admin's generated one, an
    # invitation, a reset): nothing in the console opens until the user sets their own.
    must_change_password = models.BooleanField(default=False)
    # The OpenID Connect subject ("iss sub") a single sign-on user is known by; empty: local.
    sso_subject = models.CharField(max_length=400, blank=True, db_index=True)

    def __str__(self) -> str:
        return f"account of {self.user}"


class ApiKeyQuerySet(models.QuerySet):
    def usable(self) -> "ApiKeyQuerySet":
        """Keys that authenticate now (the rule: ``core.credentials``)."""
        return self.filter(usable_filter(timezone.now(), TenantStatus.ACTIVE))


class ApiKey(models.Model):
    """A tenant's inference key; only its public prefix and HMAC hash are stored."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    secret_hash = models.CharField(max_length=64)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    # Optional per-key limits, never looser than the tenant's.
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    max_concurrent_requests = models.PositiveIntegerField(null=True, blank=True)
    # An optional budget per the tenant's quota period, in tokens and/or the tenant's
    # currency. It warns (budget alerts at the tenant's thresholds) and never blocks: the
    # tenant's quota is what stops requests.
    budget_tokens = models.PositiveBigIntegerField(null=True, blank=True)
    budget_amount = models.DecimalField(
        max_digits=14,
        decimal_places=4,
        null=True,
        blank=True,
        validators=[MinValueValidator(Decimal("0"))],
    )
    # Empty means every model the tenant may use.
    allowed_models = models.ManyToManyField(
        "deployments.CatalogModel", blank=True, related_name="+"
    )

    # A key Tollgate issues itself to run work on behalf of another key (e.g. a batch job):
    # its usage and limits count against the parent, and it dies with the work.
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.CASCADE, related_name="children"
    )

    objects = ApiKeyQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} (tg-{self.prefix}-…)"

    @property
    def masked(self) -> str:
        return f"tg-{self.prefix}-…"

    @property
    def status(self) -> str:
        if self.revoked_at:
            return "revoked"
        if not unexpired(self.expires_at, timezone.now()):
            return "expired"
        return "active"

    def clean(self) -> None:
        errors = {}
        for field in LIMIT_FIELDS:
            mine, theirs = getattr(self, field), getattr(self.tenant, field)
            if mine is not None and theirs is not None and mine > theirs:
                errors[field] = f"Must not exceed the tenant's limit of {theirs}."
        if errors:
            raise ValidationError(errors)


class AdminToken(models.Model):
    """A user's token for the admin REST API; separate from tenant inference keys."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="admin_tokens"
    )
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    secret_hash = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} (tga-{self.prefix}-…)"


class AuditLog(models.Model):
    """One change someone made: who, what, to which object, before and after."""

    at = models.DateTimeField(default=timezone.now, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_label = models.CharField(max_length=150, blank=True)
    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.SET_NULL, related_name="audit_entries"
    )
    action = models.CharField(max_length=16, choices=AuditAction)
    object_type = models.CharField(max_length=64)
    object_id = models.CharField(max_length=64, blank=True)
    object_repr = models.CharField(max_length=200, blank=True)
    changes = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["object_type", "object_id"])]

    def __str__(self) -> str:
        return f"{self.actor_label} {self.action} {self.object_type} {self.object_repr}"
