"""Usage & showback: filters, charts of tokens and cost over time, totals, CSV download.

Platform admins see every tenant; tenant admins their own; members 403 (as the export API).
The CSV is the showback export itself (metering.export), so its totals are the page's.
"""

from datetime import UTC, datetime, time, timedelta
from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import render
from django.utils import timezone

from console import queries
from console.access import export_scope
from console.forms import UsageFilterForm
from deployments.access import adapters_visible_to, models_visible_to
from metering import export
from metering.forecast import tenant_forecasts
from metering.services import filter_usage
from tenants.access import admin_tenants


def _form(request: HttpRequest) -> UsageFilterForm:
    # export_scope has refused members already: the tenants are those the user administers.
    return UsageFilterForm(
        request.GET or None,
        tenants=admin_tenants(request.user),
        models=models_visible_to(request.user),
        adapters=adapters_visible_to(request.user),
    )


def _query(form: UsageFilterForm, scope: frozenset[int] | None) -> export.ExportQuery:
    data = form.cleaned_data if form.is_bound and form.is_valid() else {}
    today = timezone.now().astimezone(UTC).date()
    first = data.get("start") or today.replace(day=1)
    last = data.get("end") or today
    if last < first:
        first, last = last, first
    return export.ExportQuery(
        start=datetime.combine(first, time.min, UTC),
        end=datetime.combine(last + timedelta(days=1), time.min, UTC),
        granularity=data.get("granularity") or "day",
        tenant_ids=scope,
        tenant=data["tenant"].slug if data.get("tenant") else "",
        key=data.get("key") or "",
        model=data["model"].served_name if data.get("model") else "",
        adapter=data["adapter"].served_name if data.get("adapter") else "",
    )


def _forecast_tenant(request: HttpRequest, form: UsageFilterForm) -> Any:
    """The tenant whose quotas the page forecasts: the one filtered on, or a tenant admin's
    only tenant."""
    data = form.cleaned_data if form.is_bound and form.is_valid() else {}
    if data.get("tenant"):
        return data["tenant"]
    tenants = admin_tenants(request.user)
    return tenants.first() if not request.user.is_staff and tenants.count() == 1 else None


@login_required
def usage(request: HttpRequest) -> HttpResponse:
    scope = export_scope(request.user)
    form = _form(request)
    q = _query(form, scope)
    group = (
        form.cleaned_data.get("group") if form.is_bound and form.is_valid() else ""
    ) or "tenant"
    rollups = filter_usage(q)
    series = queries.usage_series(rollups, group, q.granularity, q.start, q.end)
    params = request.GET.copy()
    for name in ("group", "page"):
        params.pop(name, None)
    forecast_tenant = _forecast_tenant(request, form)
    return render(
        request,
        "console/usage/page.html",
        {
            "nav": "usage",
            "form": form,
            "query": q,
            "group": group,
            "series": series,
            "totals": export.totals(q),
            "rows": queries.totals_by(rollups, group),
            "group_label": "Tenant" if group == "tenant" else "Model",
            "csv_query": params.urlencode(),
            "granularity": q.granularity,
            "last_day": q.end - timedelta(days=1),
            "currency": series["currency"],
            "forecast_tenant": forecast_tenant,
            "forecasts": tenant_forecasts(forecast_tenant, timezone.now())
            if forecast_tenant
            else [],
        },
    )


@login_required
def usage_export(request: HttpRequest) -> HttpResponse:
    """The showback (or FOCUS) CSV for the page's filters, streamed from metering.export."""
    scope = export_scope(request.user)
    form = _form(request)
    if form.is_bound and not form.is_valid():
        if "tenant" in form.errors:
            raise Http404("No such tenant.")  # another tenant's slug: as if it did not exist
        return HttpResponse(
            "Invalid filters: " + form.errors.as_text(), status=400, content_type="text/plain"
        )
    q = _query(form, scope)
    fmt = request.GET.get("format") or "showback"
    if fmt not in export.FORMATS:
        return HttpResponse("format: use showback or focus", status=400, content_type="text/plain")
    q = export.ExportQuery(**{**q.__dict__, "fmt": fmt})
    response = StreamingHttpResponse(export.csv_lines(q), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{export.filename(q)}"'
    return response
