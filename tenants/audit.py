"""Recording who changed what: every service that changes state calls ``record``."""

from collections.abc import Iterable
from datetime import date
from typing import Any

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db import models

from core.fields import EncryptedTextField
from tenants.models import AuditLog, Tenant

Actor = AbstractBaseUser | AnonymousUser | None


def snapshot(obj: models.Model, fields: Iterable[str]) -> dict[str, Any]:
    """A JSON-safe picture of some fields of a row, for before/after summaries: related rows
    by name (many-to-many ones as a sorted list), times in ISO 8601, and a secret (an
    encrypted field) only as whether it is set, never its value."""
    picture = {}
    for name in fields:
        field, value = obj._meta.get_field(name), getattr(obj, name)
        if field.many_to_many:
            value = sorted(str(related) for related in value.all())
        elif isinstance(field, EncryptedTextField):
            value = "set" if value else ""
        elif isinstance(value, models.Model):
            value = str(value)
        elif isinstance(value, date):
            value = value.isoformat()
        elif value is not None and not isinstance(value, (bool, int, float, str, list, dict)):
            value = str(value)
        picture[name] = value
    return picture


def diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Only the fields that changed, as {field: [old, new]}."""
    return {k: [before.get(k), v] for k, v in after.items() if before.get(k) != v}


def record(
    actor: Actor,
    action: str,
    obj: models.Model,
    tenant: Tenant | None = None,
    changes: dict[str, Any] | None = None,
) -> AuditLog:
    """Write one audit row. Keys appear only by prefix (their ``str``)."""
    user = actor if actor is not None and actor.is_authenticated else None
    return AuditLog.objects.create(
        actor=user,
        actor_label=user.get_username() if user else "system",
        tenant=tenant,
        action=action,
        object_type=obj._meta.model_name,
        object_id=str(obj.pk or ""),
        object_repr=str(obj)[:200],
        changes=changes or {},
    )
