"""The console's guards, on top of the rules the admin API follows.

What a user sees is ``tenants.access`` (tenants, keys, members, the audit log, usage
reports), ``deployments.access`` (catalogue models) and ``metering.services`` (usage):
pages list only that, so another tenant's object answers 404, as if it did not exist. Here
are the pages' own refusals (403): pages for platform admins only, actions for tenant admins.
"""

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404

from tenants.access import is_tenant_admin, report_tenant_ids, tenants_of
from tenants.models import Tenant

View = Callable[..., HttpResponse]


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


def export_scope(user: Any) -> frozenset[int] | None:
    """Tenants whose usage the user may see on the usage page and export: None for all
    (platform admins). Members may not (403), as on the admin API."""
    scope = report_tenant_ids(user)
    if scope is not None and not scope:
        raise PermissionDenied("Only tenant admins can see usage reports.")
    return scope
