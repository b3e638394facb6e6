"""Admin API views for webhook endpoints, their delivery log and console notices.

Tenant admins see and manage their tenants' endpoints and deliveries and see their notices;
platform admins everything, platform endpoints included; members nothing (another tenant's
objects, like a member's view of their own tenant's, answer 404).
"""

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer

from alerts import services
from alerts.models import Notice, WebhookDelivery, WebhookEndpoint
from alerts.serializers import (
    NoticeSerializer,
    WebhookDeliverySerializer,
    WebhookEndpointSecretSerializer,
    WebhookEndpointSerializer,
)
from core.api import AdminViewSetMixin, UserScopedMixin

PLATFORM_ONLY = "Only platform admins manage platform endpoints (no tenant)."


def _secret_answer(issued: services.IssuedEndpoint, context: dict, code: int) -> Response:
    data = WebhookEndpointSecretSerializer(issued.endpoint, context=context).data
    data["secret"] = issued.secret
    response = Response(data, status=code)
    response["Cache-Control"] = "no-store"
    return response


class WebhookEndpointViewSet(AdminViewSetMixin, UserScopedMixin, viewsets.ModelViewSet):
    """Webhook endpoints. The signing secret is shown once: when made and when rotated."""

    serializer_class = WebhookEndpointSerializer
    filterset_fields = {"tenant__slug": ["exact"], "tenant": ["isnull"], "enabled": ["exact"]}
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]
    bodyless_actions = AdminViewSetMixin.bodyless_actions | {"rotate_secret", "test"}

    queryset = WebhookEndpoint.objects.none()

    def scope(self, user: Any) -> QuerySet[WebhookEndpoint]:
        return services.endpoints_visible_to(user)

    @extend_schema(responses={201: WebhookEndpointSecretSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Make an endpoint. The response's `secret` is the only time it is ever shown."""
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        tenant = data.pop("tenant", None)
        if not services.may_manage(request.user, tenant):
            raise PermissionDenied(PLATFORM_ONLY if tenant is None else "Only tenant admins.")
        issued = services.create_endpoint(request.user, tenant, **data)
        return _secret_answer(issued, self.get_serializer_context(), status.HTTP_201_CREATED)

    def check_object_permissions(self, request: Request, obj: Any) -> None:
        super().check_object_permissions(request, obj)
        if not services.may_manage(request.user, obj.tenant):
            raise PermissionDenied("Only admins of the endpoint's tenant can do this.")

    def perform_update(self, serializer: BaseSerializer) -> None:
        serializer.instance = services.update_endpoint(
            self.request.user, serializer.instance, **serializer.validated_data
        )

    def perform_destroy(self, instance: WebhookEndpoint) -> None:
        services.delete_endpoint(self.request.user, instance)

    @extend_schema(request=None, responses=WebhookEndpointSecretSerializer)
    @action(detail=True, methods=["post"], url_path="rotate-secret")
    def rotate_secret(self, request: Request, pk: str) -> Response:
        """A new signing secret, in force at once; shown only in this response."""
        issued = services.rotate_secret(request.user, self.get_object())
        return _secret_answer(issued, self.get_serializer_context(), status.HTTP_200_OK)

    @extend_schema(request=None, responses={202: WebhookDeliverySerializer})
    @action(detail=True, methods=["post"])
    def test(self, request: Request, pk: str) -> Response:
        """Queue a `test` event to this endpoint (even while disabled)."""
        row = services.send_test(request.user, self.get_object())
        return Response(WebhookDeliverySerializer(row).data, status=status.HTTP_202_ACCEPTED)


class WebhookDeliveryViewSet(AdminViewSetMixin, UserScopedMixin, viewsets.ReadOnlyModelViewSet):
    """The delivery log: every event sent to an endpoint, its attempts and outcome."""

    serializer_class = WebhookDeliverySerializer
    filterset_fields = {
        "endpoint": ["exact"],
        "endpoint__tenant__slug": ["exact"],
        "event": ["exact"],
        "status": ["exact"],
        "created_at": ["gte", "lt"],
    }
    bodyless_actions = AdminViewSetMixin.bodyless_actions | {"retry"}

    queryset = WebhookDelivery.objects.none()

    def scope(self, user: Any) -> QuerySet[WebhookDelivery]:
        return services.deliveries_visible_to(user)

    @extend_schema(request=None, responses=WebhookDeliverySerializer)
    @action(detail=True, methods=["post"])
    def retry(self, request: Request, pk: str) -> Response:
        """Attempt a failed or given-up delivery again now."""
        row = self.get_object()
        if not services.may_manage(request.user, row.endpoint.tenant):
            raise PermissionDenied("Only admins of the endpoint's tenant can do this.")
        return Response(self.get_serializer(services.retry_now(request.user, row)).data)


class NoticeViewSet(
    AdminViewSetMixin,
    UserScopedMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    viewsets.GenericViewSet,
):
    """Console notices (alerts): platform admins see all, tenant admins their tenants'."""

    serializer_class = NoticeSerializer
    filterset_fields = {
        "tenant__slug": ["exact"],
        "tenant": ["isnull"],
        "event": ["exact"],
        "severity": ["exact"],
        "acknowledged_at": ["isnull"],
    }
    bodyless_actions = AdminViewSetMixin.bodyless_actions | {"acknowledge"}

    queryset = Notice.objects.none()

    def scope(self, user: Any) -> QuerySet[Notice]:
        return services.notices_visible_to(user)

    @extend_schema(request=None, responses=NoticeSerializer)
    @action(detail=True, methods=["post"])
    def acknowledge(self, request: Request, pk: str) -> Response:
        """Mark the notice as seen; its console banner goes away for everyone."""
        notice = services.acknowledge(request.user, self.get_object())
        return Response(self.get_serializer(notice).data)
