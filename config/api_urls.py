"""The admin REST API under /api/v1/: one router for every app's resources, and the
password-for-token exchange."""

from django.urls import path

from alerts.api import NoticeViewSet, WebhookDeliveryViewSet, WebhookEndpointViewSet
from core.api import AdminRouter
from deployments.api import (
    AdapterViewSet,
    AllowedImageViewSet,
    CatalogModelViewSet,
    DeploymentViewSet,
    EngineProfileViewSet,
    NodeViewSet,
    OperationViewSet,
)
from metering.api import (
    BillCheckView,
    KeyForecastView,
    PriceViewSet,
    TenantForecastView,
    UsageEventViewSet,
)
from tenants.api import (
    AdminTokenViewSet,
    ApiKeyViewSet,
    AuditLogViewSet,
    MembershipViewSet,
    TenantViewSet,
    UserViewSet,
)
from tenants.token_login import TokenLoginView

router = AdminRouter()
router.register("tenants", TenantViewSet, basename="tenant")
router.register("keys", ApiKeyViewSet, basename="apikey")
router.register("members", MembershipViewSet, basename="membership")
router.register("users", UserViewSet, basename="user")
router.register("tokens", AdminTokenViewSet, basename="admintoken")
router.register("models", CatalogModelViewSet, basename="catalogmodel")
router.register("adapters", AdapterViewSet, basename="adapter")
router.register("prices", PriceViewSet, basename="price")
router.register("nodes", NodeViewSet, basename="node")
router.register("deployments", DeploymentViewSet, basename="deployment")
router.register("operations", OperationViewSet, basename="operation")
router.register("engine-profiles", EngineProfileViewSet, basename="engineprofile")
router.register("engine-images", AllowedImageViewSet, basename="allowedimage")
router.register("usage", UsageEventViewSet, basename="usageevent")
router.register("audit", AuditLogViewSet, basename="auditlog")
router.register("webhooks", WebhookEndpointViewSet, basename="webhookendpoint")
router.register("webhook-deliveries", WebhookDeliveryViewSet, basename="webhookdelivery")
router.register("notices", NoticeViewSet, basename="notice")
urlpatterns = [
    path("auth/token/", TokenLoginView.as_view(), name="auth-token"),
    # Before the router's routes, so these are not taken for a detail action.
    path("tenants/<slug:slug>/forecast/", TenantForecastView.as_view(), name="tenant-forecast"),
    path("keys/<int:pk>/forecast/", KeyForecastView.as_view(), name="apikey-forecast"),
    path(
        "deployments/<str:name>/bill-check/", BillCheckView.as_view(), name="deployment-bill-check"
    ),
    *router.urls,
]
