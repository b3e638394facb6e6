"""Admission: each model's engine slots, its adaptive ceiling over time, who waits and how long."""

import time
from datetime import timedelta
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from config.redis import get_redis
from console.access import staff_required
from deployments.models import CatalogModel
from gateway.admission import CLASS_INDEX, pool_keys, wait_stats_key
from gateway.models import AdmissionSample
from gateway.tuning import ready_pools
from tenants.models import Tenant

CLASS_OF = {index: name for name, index in CLASS_INDEX.items()}


def _pool_row(model: CatalogModel, budget: int) -> dict[str, Any]:
    client = get_redis()
    running_key, queue_key, _, _, ceiling_key = pool_keys(model.pk)
    queued = {name: 0 for name in CLASS_INDEX}
    for _, rank in client.zrange(queue_key, 0, -1, withscores=True):
        queued[CLASS_OF.get(int(rank // 1e13), "P2")] += 1
    ceiling = client.get(ceiling_key)
    return {
        "model": model, "budget": budget, "ceiling": int(ceiling) if ceiling else budget,
        "running": client.zcard(running_key), "queued": queued,
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
    hour = int(time.time() // 3600)
    totals: dict[tuple[str, int], list[float]] = {}
    for h in (hour - 1, hour):
        for field, value in get_redis().hgetall(wait_stats_key(h)).items():
            priority, tenant_id, kind = field.decode().split("|")
            entry = totals.setdefault((priority, int(tenant_id)), [0, 0.0])
            entry[0 if kind == "n" else 1] += float(value)
    tenants = Tenant.objects.in_bulk([t for _, t in totals])
    rows = [
        {"priority": p, "tenant": tenants.get(t), "count": int(n), "mean": s / n if n else 0.0}
        for (p, t), (n, s) in totals.items()
    ]
    return sorted(rows, key=lambda r: (r["priority"], -r["count"]))


@staff_required
def admission(request: HttpRequest) -> HttpResponse:
    pools = ready_pools()
    models = CatalogModel.objects.in_bulk(list(pools))
    rows = [_pool_row(models[m], budget) for m, (budget, _) in pools.items() if m in models]
    recent = AdmissionSample.objects.filter(model_id__in=list(pools)).select_related("model")[:20]
    return render(request, "console/admission/page.html", {
        "nav": "admission", "rows": sorted(rows, key=lambda r: r["model"].served_name),
        "history": _history(list(pools)), "recent": recent, "waits": _waits(),
    })
