"""HTTP views of metering outside the router: ``GET /v1/usage`` for tenant keys, and the
showback CSV export of the admin API."""

from typing import Any

from django.core.exceptions import ValidationError
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.utils import timezone
from django.views.decorators.http import require_GET
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from metering import export, forecast, usage
from metering.export import parse_moment
from metering.periods import period_end, period_start
from tenants import access
from tenants.auth import authenticate_api_key, invalid_key


def _bad_request(message: str, param: str) -> JsonResponse:
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    }
    return JsonResponse(body, status=400)


@require_GET
def v1_usage(request: HttpRequest) -> JsonResponse:
    """A tenant key's own usage and its tenant's usage and remaining quota."""
    key = authenticate_api_key(request)
    if key is None:
        return invalid_key()
    now = timezone.now()
    tenant = key.tenant
    group_by = request.GET.get("group_by") or None
    if group_by not in (None, "model", "day"):
        return _bad_request("group_by must be 'model' or 'day'.", "group_by")
    try:
        start = (
            parse_moment(request.GET["start"], "start")
            if request.GET.get("start")
            else period_start(tenant.quota_period, now)
        )
        end = (
            parse_moment(request.GET["end"], "end")
            if request.GET.get("end")
            else period_end(tenant.quota_period, now)
        )
    except ValidationError as exc:
        name, messages = next(iter(exc.message_dict.items()))
        return _bad_request(messages[0], name)
    if end <= start:
        return _bad_request("end must be after start.", "end")
    body = usage.self_service(key, start, end, group_by, now)
    # At the last 24 h's rate, when the tenant's quotas and the key's budgets run out.
    body["forecast"] = {
        "tenant": [f.as_dict() for f in forecast.tenant_forecasts(tenant, now)],
        "key": [f.as_dict() for f in forecast.key_forecasts(key, now)],
    }
    return JsonResponse(body)


class CSVRenderer(BaseRenderer):
    """Lets clients ask for text/csv; only error bodies are ever rendered through it."""

    media_type = "text/csv"
    format = "csv"

    def render(self, data: Any, accepted_media_type: Any = None, context: Any = None) -> bytes:
        return JSONRenderer().render(data)


class _FormatIsOurs:
    """DRF's settings, except that ``?format=`` names the column set, not a renderer."""

    URL_FORMAT_OVERRIDE = None

    def __getattr__(self, name: str) -> Any:
        return getattr(api_settings, name)


class ExportNegotiation(DefaultContentNegotiation):
    settings = _FormatIsOurs()


class UsageExportView(APIView):
    """Showback export as CSV, streamed. Platform admins: every tenant; tenant admins: their
    own (another tenant answers 404); members: 403."""

    renderer_classes = [JSONRenderer, CSVRenderer]
    content_negotiation_class = ExportNegotiation

    @extend_schema(
        summary="Showback export (CSV)",
        parameters=[
            OpenApiParameter("period", str, description="Month 2026-11 or day 2026-11-26."),
            OpenApiParameter("start", str, description="Date or ISO time (instead of period)."),
            OpenApiParameter("end", str, description="Date or ISO time, exclusive."),
            OpenApiParameter("tenant", str, description="Tenant slug."),
            OpenApiParameter("key", str, description="API key prefix."),
            OpenApiParameter(
                "model", str, description="Model served name (its adapters' usage included)."
            ),
            OpenApiParameter("adapter", str, description="LoRA adapter served name."),
            OpenApiParameter("granularity", str, enum=export.GRANULARITIES, default="day"),
            OpenApiParameter("format", str, enum=export.FORMATS, default="showback"),
        ],
        responses={(200, "text/csv"): OpenApiTypes.STR},
    )
    def get(self, request: Request) -> StreamingHttpResponse:
        query = export.parse_query(request.query_params, self._scope(request))
        response = StreamingHttpResponse(
            export.csv_lines(query), content_type="text/csv; charset=utf-8"
        )
        response["Content-Disposition"] = f'attachment; filename="{export.filename(query)}"'
        return response

    def _scope(self, request: Request) -> frozenset[int] | None:
        user, slug = request.user, request.query_params.get("tenant")
        scope = access.report_tenant_ids(user)
        if slug:
            tenant = access.tenants_of(user).filter(slug=slug).first()
            if tenant is None:
                raise NotFound("No such tenant.")  # another tenant's: as if it did not exist
            if scope is not None and tenant.pk not in scope:
                raise PermissionDenied("Only tenant admins can export usage.")
        elif scope is not None and not scope:
            raise PermissionDenied("Only tenant admins can export usage.")
        return scope
