"""URL map: console pages, the admin REST API and its schema, health."""

from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from config.views import favicon, healthz, v1_not_found
from core import problems

# Under /api/ these answer problem+json; everywhere else the console's pages.
handler400 = "core.problems.bad_request"
handler403 = "core.problems.permission_denied"
handler404 = "core.problems.page_not_found"
handler500 = "core.problems.server_error"

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("favicon.ico", favicon, name="favicon"),
    # Single sign-on (OpenID Connect); the names are mozilla-django-oidc's.
    path("", include("console.sso_urls")),
    path("", include("metering.urls")),  # /v1/usage, /api/v1/usage/export.csv
    path("", include("batches.urls")),  # /v1/files, /v1/batches
    # The rest of /v1 is the gateway's (config/asgi.py); what reaches Django is not a path.
    re_path(r"^v1/", v1_not_found),
    path("api/v1/", include("config.api_urls")),
    path("api/problems/", problems.problem_types, name="api-problems"),
    path("api/problems/<slug:slug>", problems.problem_types, name="api-problem"),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    path("api/redoc/", SpectacularRedocView.as_view(url_name="api-schema"), name="api-redoc"),
    # Nothing else under /api/ is a page: a problem+json 404 for any method, DEBUG or not.
    re_path(r"^api/(?P<rest>.*)$", problems.api_not_found),
    path("", include("console.urls")),  # the web console (last: its paths are the rest)
]
