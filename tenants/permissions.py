"""Who may change what on the admin API.

Objects outside a user's tenants are filtered out of querysets (``tenants.access``), so they
answer 404; these classes then decide between reading and changing (403 for tenant members).
"""

from typing import Any

from rest_framework import permissions
from rest_framework.request import Request
from rest_framework.views import APIView

from tenants.access import is_tenant_admin


class IsPlatformAdmin(permissions.BasePermission):
    """Platform admins (staff users) only."""

    message = "Only platform admins can do this."

    def has_permission(self, request: Request, view: APIView) -> bool:
        return bool(request.user and request.user.is_staff)


class PlatformAdminWrites(permissions.IsAuthenticated):
    """Anyone authenticated may read what their queryset shows; only platform admins write.

    On a single object the staff check waits until the object was found in the user's
    queryset, so another tenant's object answers 404 before any 403.
    """

    message = "Only platform admins can change this."

    def has_permission(self, request: Request, view: APIView) -> bool:
        if not super().has_permission(request, view):
            return False
        if request.method in permissions.SAFE_METHODS or request.user.is_staff:
            return True
        return bool(getattr(view, "detail", False))

    def has_object_permission(self, request: Request, view: APIView, obj: Any) -> bool:
        return request.method in permissions.SAFE_METHODS or request.user.is_staff


class TenantAdminWrites(permissions.IsAuthenticated):
    """Members read; tenant admins (and platform admins) change objects of their tenant."""

    message = "Only tenant admins can do this."

    def has_object_permission(self, request: Request, view: APIView, obj: Any) -> bool:
        if request.method in permissions.SAFE_METHODS:
            return True
        return is_tenant_admin(request.user, obj.tenant_id)
