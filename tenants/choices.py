"""Names of tenant states, roles, priority classes and quota periods."""

from django.db import models


class TenantStatus(models.TextChoices):
    ACTIVE = "active", "Active"
    SUSPENDED = "suspended", "Suspended"


class Priority(models.TextChoices):
    """Admission classes: P0 is served before P1, P1 before P2."""

    INTERACTIVE = "P0", "P0 interactive"
    STANDARD = "P1", "P1 standard"
    BATCH = "P2", "P2 batch"


class Role(models.TextChoices):
    ADMIN = "admin", "Tenant admin"
    MEMBER = "member", "Tenant member"


class QuotaPeriod(models.TextChoices):
    DAILY = "daily", "Daily"
    WEEKLY = "weekly", "Weekly"
    MONTHLY = "monthly", "Monthly"


class ModelAccess(models.TextChoices):
    """Which catalogue models a tenant may call."""

    ALL = "all", "All public models and models granted to the tenant"
    LISTED = "listed", "Only the listed models"


class AuditAction(models.TextChoices):
    CREATE = "create", "Created"
    UPDATE = "update", "Updated"
    DELETE = "delete", "Deleted"
    REVOKE = "revoke", "Revoked"
    SUSPEND = "suspend", "Suspended"
    ACTIVATE = "activate", "Activated"
    GRANT = "grant", "Granted"
    UNGRANT = "ungrant", "Grant removed"
    LOGIN = "login", "Logged in"
    ACTION = "action", "Action"
