"""Who sees what in the console: the same rules as the admin API, reused, never rewritten.

Objects outside the user's tenants answer 404 (as if they did not exist); actions a
tenant member may not take answer 403. Scoping queries come from the API's own viewsets
and the permission helpers in config/permissions.py.
"""

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404

from config.permissions import admin_tenant_ids, is_tenant_admin, member_tenant_ids
from deployments.services import models_visible_to
from metering.api import UsageEventViewSet
from metering.models import UsageRollup
from tenants.api import ApiKeyViewSet, AuditLogViewSet
from tenants.models import ApiKey, AuditLog, Tenant
from tenants.services import role_in, tenants_of

View = Callable[..., HttpResponse]

__all__ = [
    "admin_tenant_ids",
    "admin_tenants",
    "audit_visible_to",
    "is_tenant_admin",
    "keys_visible_to",
    "member_tenant_ids",
    "models_visible_to",
    "require_tenant_admin",
    "role_in",
    "staff_required",
    "tenant_or_404",
    "tenants_of",
    "usage_events_visible_to",
    "usage_rollups_visible_to",
]


def staff_required(view: View) -> View:
    """Platform admins only: others get the console's 403 page."""

    @login_required
    @wraps(view)
    def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not request.user.is_staff:
            raise PermissionDenied("Only platform admins can open this page.")
        return view(request, *args, **kwargs)

    return wrapped


def tenant_or_404(user: Any, slug: str) -> Tenant:
    return get_object_or_404(tenants_of(user), slug=slug)


def require_tenant_admin(user: Any, tenant: Tenant) -> None:
    if not is_tenant_admin(user, tenant.pk):
        raise PermissionDenied("Only tenant admins can do this.")


def keys_visible_to(user: Any) -> QuerySet[ApiKey]:
    """Keys as the admin API scopes them: admins their tenants', members the keys they made."""
    return ApiKeyViewSet().scope(user)


def audit_visible_to(user: Any) -> QuerySet[AuditLog]:
    return AuditLogViewSet().scope(user)


def usage_events_visible_to(user: Any) -> QuerySet:
    return UsageEventViewSet().scope(user)


def usage_rollups_visible_to(user: Any, tenant: Tenant) -> QuerySet[UsageRollup]:
    """A tenant's hourly usage as its admins see it; members see their own keys' usage,
    as the admin API shows them their own keys' requests."""
    rollups = UsageRollup.objects.filter(tenant=tenant)
    if is_tenant_admin(user, tenant.pk):
        return rollups
    return rollups.filter(api_key__created_by=user)


def admin_tenants(user: Any) -> QuerySet[Tenant]:
    """The tenants whose keys, usage and audit log the user manages (all for platform admins)."""
    if user.is_staff:
        return Tenant.objects.all()
    return Tenant.objects.filter(pk__in=admin_tenant_ids(user))


def export_scope(user: Any) -> frozenset[int] | None:
    """Tenants whose usage the user may export: None for all (platform admins).

    Members may not export (403), as on the admin API.
    """
    if user.is_staff:
        return None
    admin_of = admin_tenant_ids(user)
    if not admin_of:
        raise PermissionDenied("Only tenant admins can see usage reports.")
    return frozenset(admin_of)
