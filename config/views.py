"""Process-level views: the container health check, the 404 page."""

from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views import defaults
from django.views.decorators.http import require_GET

from core.redis import get_redis


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    """200 when PostgreSQL and Redis answer, 503 naming what does not."""
    failures = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
        failures["database"] = exc.__class__.__name__
    try:
        get_redis().ping()
    except Exception as exc:  # noqa: BLE001
        failures["redis"] = exc.__class__.__name__
    if failures:
        return JsonResponse({"status": "unhealthy", "failures": failures}, status=503)
    return JsonResponse({"status": "ok"})


def not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """OpenAI's JSON 404 under /v1 (SDKs print an HTML page as a wall of markup); the
    console's page elsewhere."""
    if request.path.startswith("/v1/"):
        message = f"Invalid URL ({request.method} {request.path})"
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
        return JsonResponse({"error": error}, status=404)
    return defaults.page_not_found(request, exception)
