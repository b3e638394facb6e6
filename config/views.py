"""Process-level views: the container health check, the favicon, the /v1 404."""

from django.db import connection
from django.http import HttpRequest, HttpResponsePermanentRedirect, JsonResponse
from django.templatetags.static import static
from django.views.decorators.csrf import csrf_exempt
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


@csrf_exempt  # an API path: answer every method the same, no console session involved
def v1_not_found(request: HttpRequest) -> JsonResponse:
    """OpenAI's JSON 404 for a /v1 path nothing serves (SDKs print an HTML page as a wall of
    markup)."""
    message = f"Invalid URL ({request.method} {request.path})"
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    return JsonResponse({"error": error}, status=404)


@require_GET
def favicon(request: HttpRequest) -> HttpResponsePermanentRedirect:
    """Browsers ask for /favicon.ico on pages that name no icon (API docs, JSON answers)."""
    return HttpResponsePermanentRedirect(static("console/favicon.svg"))
