"""Admin API views for tenants, API keys, members, users, admin tokens and the audit log."""

from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer

from core.api import AdminViewSetMixin, UserScopedMixin
from tenants import access, services
from tenants.choices import TenantStatus
from tenants.models import AdminToken, ApiKey, AuditLog, Membership, Tenant
from tenants.permissions import IsPlatformAdmin, PlatformAdminWrites, TenantAdminWrites
from tenants.serializers import (
    AdminTokenCreatedSerializer,
    AdminTokenSerializer,
    ApiKeyCreatedSerializer,
    ApiKeySerializer,
    AuditLogSerializer,
    BoostSerializer,
    MembershipSerializer,
    TenantSerializer,
    UserSerializer,
)

User = get_user_model()


def _forbid_unless_tenant_admin(request: Request, tenant: Tenant) -> None:
    if not access.is_tenant_admin(request.user, tenant.pk):
        raise PermissionDenied("Only tenant admins can do this.")


class TenantViewSet(AdminViewSetMixin, UserScopedMixin, viewsets.ModelViewSet):
    """Tenants. Platform admins manage all; tenant users see only their own."""

    serializer_class = TenantSerializer
    permission_classes = [PlatformAdminWrites]
    lookup_field = "slug"
    filterset_fields = ["status", "priority"]

    queryset = Tenant.objects.none()

    def scope(self, user: Any) -> QuerySet[Tenant]:
        return access.tenants_of(user).prefetch_related("allowed_models")

    def perform_create(self, serializer: BaseSerializer) -> None:
        serializer.instance = services.create_tenant(self.request.user, **serializer.validated_data)

    def perform_update(self, serializer: BaseSerializer) -> None:
        serializer.instance = services.update_tenant(
            self.request.user, serializer.instance, **serializer.validated_data
        )

    def perform_destroy(self, instance: Tenant) -> None:
        services.delete_tenant(self.request.user, instance)

    @extend_schema(request=None, responses=TenantSerializer)
    @action(detail=True, methods=["post"])
    def suspend(self, request: Request, slug: str) -> Response:
        """Suspend the tenant: every key stops working within a second."""
        tenant = services.set_tenant_status(request.user, self.get_object(), TenantStatus.SUSPENDED)
        return Response(self.get_serializer(tenant).data)

    @extend_schema(request=BoostSerializer, responses=TenantSerializer)
    @action(detail=True, methods=["post"])
    def boost(self, request: Request, slug: str) -> Response:
        """Serve the tenant as P0 (interactive) for the next `minutes`; 0 ends the boost."""
        tenant = self.get_object()
        body = BoostSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        tenant = services.grant_interactive(request.user, tenant, body.validated_data["minutes"])
        return Response(self.get_serializer(tenant).data)

    @extend_schema(request=None, responses=TenantSerializer)
    @action(detail=True, methods=["post"])
    def activate(self, request: Request, slug: str) -> Response:
        """Reactivate a suspended tenant."""
        tenant = services.set_tenant_status(request.user, self.get_object(), TenantStatus.ACTIVE)
        return Response(self.get_serializer(tenant).data)


class ApiKeyViewSet(
    AdminViewSetMixin,
    UserScopedMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    viewsets.ReadOnlyModelViewSet,
):
    """Inference API keys. Tenant admins manage their tenant's; members see the keys they made."""

    serializer_class = ApiKeySerializer
    permission_classes = [TenantAdminWrites]
    filterset_fields = {"tenant__slug": ["exact"], "revoked_at": ["isnull"]}

    queryset = ApiKey.objects.none()

    def scope(self, user: Any) -> QuerySet[ApiKey]:
        return access.keys_visible_to(user)

    @extend_schema(responses={201: ApiKeyCreatedSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Issue a key. The response's `key` is the only time the key is ever shown."""
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        _forbid_unless_tenant_admin(request, serializer.validated_data["tenant"])
        issued = services.issue_api_key(request.user, **serializer.validated_data)
        data = ApiKeyCreatedSerializer(issued.key, context=self.get_serializer_context()).data
        data["key"] = issued.plaintext
        return Response(data, status=status.HTTP_201_CREATED)

    def perform_update(self, serializer: BaseSerializer) -> None:
        data = dict(serializer.validated_data)
        data.pop("tenant", None)
        serializer.instance = services.update_api_key(
            self.request.user, serializer.instance, **data
        )

    @extend_schema(request=None, responses=ApiKeySerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str) -> Response:
        """Revoke the key for good; requests with it fail within a second."""
        key = services.revoke_api_key(request.user, self.get_object())
        return Response(self.get_serializer(key).data)


class MembershipViewSet(AdminViewSetMixin, UserScopedMixin, viewsets.ModelViewSet):
    """Who belongs to a tenant and in which role. Tenant admins manage their tenant's."""

    serializer_class = MembershipSerializer
    permission_classes = [TenantAdminWrites]
    filterset_fields = {"tenant__slug": ["exact"], "role": ["exact"]}
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    queryset = Membership.objects.none()

    def scope(self, user: Any) -> QuerySet[Membership]:
        return access.members_visible_to(user)

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        # Members learn nothing from validation (e.g. "already a member"): refuse them first.
        slug = request.data.get("tenant")
        tenant = (
            Tenant.objects.filter(
                slug=slug, pk__in=self.scope(request.user).values("tenant_id")
            ).first()
            if isinstance(slug, str)
            else None
        )
        if tenant is not None:
            _forbid_unless_tenant_admin(request, tenant)
        return super().create(request, *args, **kwargs)

    def perform_create(self, serializer: BaseSerializer) -> None:
        data = serializer.validated_data
        _forbid_unless_tenant_admin(self.request, data["tenant"])
        serializer.instance = services.add_member(
            self.request.user, data["tenant"], data["user"], data["role"]
        )

    def perform_update(self, serializer: BaseSerializer) -> None:
        data = serializer.validated_data
        if (
            "tenant" in data
            and data["tenant"] != serializer.instance.tenant
            or ("user" in data and data["user"] != serializer.instance.user)
        ):
            raise ValidationError({"detail": "Only the role of a membership can change."})
        role = data.get("role", serializer.instance.role)
        serializer.instance = services.change_role(self.request.user, serializer.instance, role)

    def perform_destroy(self, instance: Membership) -> None:
        services.remove_member(self.request.user, instance)


class UserViewSet(AdminViewSetMixin, viewsets.ModelViewSet):
    """Console users, by username. Platform admins only."""

    serializer_class = UserSerializer
    permission_classes = [IsPlatformAdmin]
    lookup_field = "username"
    lookup_value_regex = r"[^/]+"
    legacy_pk_lookup = True
    queryset = User.objects.order_by("username").prefetch_related("memberships__tenant")
    filterset_fields = ["is_staff", "is_active"]
    http_method_names = ["get", "post", "patch", "head", "options"]

    def perform_create(self, serializer: BaseSerializer) -> None:
        serializer.instance = services.create_user(self.request.user, **serializer.validated_data)

    def perform_update(self, serializer: BaseSerializer) -> None:
        serializer.instance = services.update_user(
            self.request.user, serializer.instance, **serializer.validated_data
        )


class AdminTokenViewSet(
    AdminViewSetMixin, UserScopedMixin, mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet
):
    """Your own admin API tokens (`Authorization: Bearer tga-…`)."""

    serializer_class = AdminTokenSerializer

    queryset = AdminToken.objects.none()

    def scope(self, user: Any) -> QuerySet[AdminToken]:
        return access.tokens_of(user)

    @extend_schema(responses={201: AdminTokenCreatedSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Create a token. The response's `token` is the only time it is ever shown."""
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        issued = services.issue_admin_token(request.user, **serializer.validated_data)
        data = AdminTokenCreatedSerializer(issued.token).data
        data["token"] = issued.plaintext
        return Response(data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=AdminTokenSerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str) -> Response:
        """Revoke the token for good."""
        token = services.revoke_admin_token(request.user, self.get_object())
        return Response(self.get_serializer(token).data)


class AuditLogViewSet(AdminViewSetMixin, UserScopedMixin, viewsets.ReadOnlyModelViewSet):
    """Who changed what. Platform admins see all; tenant admins their tenant's entries."""

    serializer_class = AuditLogSerializer
    filterset_fields = {
        "tenant__slug": ["exact"],
        "object_type": ["exact"],
        "action": ["exact"],
        "at": ["gte", "lt"],
    }

    queryset = AuditLog.objects.none()

    def scope(self, user: Any) -> QuerySet[AuditLog]:
        return access.audit_visible_to(user)
