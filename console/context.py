"""Template context for every console page: which navigation the user gets."""

from typing import Any

from django.http import HttpRequest

from tenants.access import admin_tenant_ids


def console(request: HttpRequest) -> dict[str, Any]:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated or user.is_staff:
        return {}
    return {"console_is_tenant_admin": bool(admin_tenant_ids(user))}
