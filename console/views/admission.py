"""Admission: each model's engine slots, its adaptive ceiling over time, who waits and how long."""

from datetime import timedelta
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from console.access import staff_required
from deployments.models import CatalogModel
from gateway.admission import pool_status, wait_stats
from gateway.models import AdmissionSample
from gateway.tuning import ready_pools
from tenants.models import Tenant


def _pool_row(model: CatalogModel, budget: int) -> dict[str, Any]:
    status = pool_status(model.pk, budget)
    return {
        "model": model,
        "budget": budget,
        "ceiling": status.ceiling,
        "running": status.running,
        "queued": status.waiting,
    }


def _history(model_ids: list[int]) -> dict[str, Any]:
    since = timezone.now() - timedelta(hours=6)
    samples = AdmissionSample.objects.filter(model_id__in=model_ids, at__gte=since).order_by("at")
    series: dict[int, dict[str, list]] = {}
    for s in samples:
        row = series.setdefault(s.model_id, {"t": [], "ceiling": [], "budget": [], "tps": []})
        row["t"].append(s.at.strftime("%H:%M:%S"))
        row["ceiling"].append(s.ceiling)
        row["budget"].append(s.budget)
        row["tps"].append(round(s.tokens_per_second, 1))
    return {str(k): v for k, v in series.items()}


def _waits() -> list[dict[str, Any]]:
    """Queue waits this hour and the last, by class and tenant."""
    stats = wait_stats(hours=2)
    tenants = Tenant.objects.in_bulk([w.tenant_id for w in stats])
    rows = [
        {
            "priority": w.priority,
            "tenant": tenants.get(w.tenant_id),
            "count": w.count,
            "mean": w.mean,
        }
        for w in stats
    ]
    return sorted(rows, key=lambda r: (r["priority"], -r["count"]))


@staff_required
def admission(request: HttpRequest) -> HttpResponse:
    pools = ready_pools()
    models = CatalogModel.objects.in_bulk(list(pools))
    rows = [_pool_row(models[m], budget) for m, (budget, _) in pools.items() if m in models]
    recent = AdmissionSample.objects.filter(model_id__in=list(pools)).select_related("model")[:20]
    return render(
        request,
        "console/admission/page.html",
        {
            "nav": "admission",
            "rows": sorted(rows, key=lambda r: r["model"].served_name),
            "history": _history(list(pools)),
            "recent": recent,
            "waits": _waits(),
        },
    )
