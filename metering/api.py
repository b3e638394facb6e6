"""Admin API views for prices and usage events."""

from typing import Any

from django.db.models import QuerySet
from django.shortcuts import get_object_or_404
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.exceptions import ValidationError
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import AdminViewSetMixin, UserScopedMixin
from deployments.models import Deployment
from metering import bill_check, forecast, services
from metering.models import Price, UsageEvent
from metering.serializers import (
    BillCheckSerializer,
    ForecastSerializer,
    PriceSerializer,
    UsageEventSerializer,
)
from tenants import access
from tenants.permissions import IsPlatformAdmin, PlatformAdminWrites


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


def _forecast_answer(tenant: Any, key: Any, forecasts: list[forecast.Forecast]) -> Response:
    now = timezone.now()
    return Response(
        {
            "tenant": tenant.slug,
            "key": None if key is None else {"id": key.pk, "name": key.name, "prefix": key.masked},
            "at": now.isoformat(),
            "window_hours": int(forecast.WINDOW.total_seconds() // 3600),
            "forecasts": [f.as_dict() for f in forecasts],
        }
    )


class TenantForecastView(APIView):
    """GET /api/v1/tenants/<slug>/forecast/: when each of the tenant's quotas runs out at the
    last 24 h's rate. Anyone who sees the tenant (and its quota) sees its forecast."""

    permission_classes = [IsAuthenticated]

    @extend_schema(responses=ForecastSerializer)
    def get(self, request: Request, slug: str) -> Response:
        tenant = get_object_or_404(access.tenants_of(request.user), slug=slug)
        return _forecast_answer(tenant, None, forecast.tenant_forecasts(tenant, timezone.now()))


class KeyForecastView(APIView):
    """GET /api/v1/keys/<id>/forecast/: when each of the key's budgets runs out at the last
    24 h's rate (a key without a budget has none). Seen by whoever sees the key."""

    permission_classes = [IsAuthenticated]

    @extend_schema(responses=ForecastSerializer)
    def get(self, request: Request, pk: int) -> Response:
        key = get_object_or_404(access.keys_visible_to(request.user), pk=pk)
        forecasts = forecast.key_forecasts(key, timezone.now())
        return _forecast_answer(key.tenant, key, forecasts)


class BillCheckView(APIView):
    """GET /api/v1/deployments/<name>/bill-check/?hours=24: the bill checked against the
    deployment's engines (metering/engine_ledger.py): per replica, the tokens its engine
    counted, Tollgate billed and the drift between them over the window, and per hour.
    Platform admins only."""

    permission_classes = [IsPlatformAdmin]

    @extend_schema(
        responses=BillCheckSerializer,
        parameters=[OpenApiParameter("hours", int, description="The window, 1 to 744 hours.")],
    )
    def get(self, request: Request, name: str) -> Response:
        deployment = get_object_or_404(Deployment, name=name)
        try:
            hours = int(request.query_params.get("hours", 24))
        except ValueError:
            hours = 0
        if not 1 <= hours <= 24 * 31:
            raise ValidationError({"hours": "A whole number of hours from 1 to 744."})
        checks = bill_check.replica_checks([deployment], hours)
        return Response(
            {
                "deployment": deployment.name,
                "hours": hours,
                "since": bill_check.window_start(hours),
                "replicas": [check.as_dict() for check in checks],
                "by_hour": [
                    {
                        "hour": row.hour,
                        "replica": row.replica_index,
                        "replica_id": row.replica_id,
                        **{name: getattr(row, name) for name in bill_check.SUMMED},
                    }
                    for row in bill_check.hours_of(deployment, hours)
                ],
            }
        )
