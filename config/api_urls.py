"""The admin REST API under /api/v1/: one router for every app's resources, and the
password-for-token exchange."""

from django.urls import path

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
from metering.api import PriceViewSet, UsageEventViewSet
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
urlpatterns = [
    path("auth/token/", TokenLoginView.as_view(), name="auth-token"),
    *router.urls,
]
