"""Admin API views for prices and usage events."""

from typing import Any

from django.db.models import QuerySet
from rest_framework import mixins, status, viewsets
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response

from core.api import AdminViewSetMixin, UserScopedMixin
from metering import services
from metering.models import Price, UsageEvent
from metering.serializers import PriceSerializer, UsageEventSerializer
from tenants.permissions import PlatformAdminWrites


class PriceViewSet(
    AdminViewSetMixin, UserScopedMixin, mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet
):
    """Price versions per model and adapter. Creating a price starts a new version; none is
    ever edited."""

    serializer_class = PriceSerializer
    permission_classes = [IsAuthenticated, PlatformAdminWrites]
    filterset_fields = {
        "model__served_name": ["exact"],
        "adapter__served_name": ["exact"],
        "adapter": ["isnull"],
        "currency": ["exact"],
    }

    queryset = Price.objects.none()

    def scope(self, user: Any) -> QuerySet[Price]:
        return services.prices_visible_to(user)

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        price = services.set_price(
            request.user,
            data["model"],
            data["input_per_mtok"],
            data.get("cached_input_per_mtok"),
            data["output_per_mtok"],
            currency=data.get("currency", "USD"),
            effective_from=data.get("effective_from"),
            adapter=data.get("adapter"),
        )
        return Response(self.get_serializer(price).data, status=status.HTTP_201_CREATED)


class UsageEventViewSet(AdminViewSetMixin, UserScopedMixin, viewsets.ReadOnlyModelViewSet):
    """One row per request. Tenant admins see their tenant's; members their own keys'."""

    serializer_class = UsageEventSerializer
    lookup_field = "request_id"
    filterset_fields = {
        "tenant__slug": ["exact"],
        "model__served_name": ["exact"],
        "adapter__served_name": ["exact"],
        "api_key__prefix": ["exact"],
        "status": ["exact"],
        "occurred_at": ["gte", "lt"],
    }

    queryset = UsageEvent.objects.none()

    def scope(self, user: Any) -> QuerySet[UsageEvent]:
        return services.usage_events_visible_to(user)
