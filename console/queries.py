"""Read-only queries for console pages (dashboard figures, charts). No rules live here."""

import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import orjson
from django.db.models import Count, F, Q, QuerySet, Sum
from django.db.models.functions import Trunc
from django.utils import timezone

from core.keyspace import usage_stream
from core.redis import get_redis
from core.usage import FIELD
from deployments import fleet
from deployments.choices import DeploymentState, OperationStatus
from deployments.models import Deployment, Node, Operation, Replica
from metering.models import DeadLetter, Price, UsageEvent, UsageRollup
from metering.services import price_at

LIVE_WINDOW_SECONDS = 60
LIVE_MAX_EVENTS = 20000


def live_rates(window: int = LIVE_WINDOW_SECONDS) -> dict[str, Any]:
    """Requests/s, tokens/s and errors over the last minute, from the gateway's usage stream.

    The stream's ids are millisecond timestamps, so the last minute is one XRANGE, fresh
    whether or not the metering consumer has stored the events yet. (The stream is trimmed
    only below what metering acknowledged, and never within minutes.)
    """
    since_ms = int((time.time() - window) * 1000)
    entries = get_redis().xrange(
        usage_stream(), min=f"{since_ms}-0", max="+", count=LIVE_MAX_EVENTS
    )
    requests = tokens = errors = 0
    for _, fields in entries:
        try:
            event = orjson.loads(fields[FIELD])
        except (KeyError, orjson.JSONDecodeError):
            continue
        requests += 1
        tokens += int(event.get("prompt_tokens", 0)) + int(event.get("completion_tokens", 0))
        errors += event.get("status") == "error"
    return {
        "window": window,
        "requests": requests,
        "tokens": tokens,
        "errors": errors,
        "requests_per_s": requests / window,
        "tokens_per_s": tokens / window,
        "capped": len(entries) >= LIVE_MAX_EVENTS,
    }


def nodes_with_memory() -> list[dict[str, Any]]:
    rows = []
    for node in Node.objects.annotate(
        ready=Count("replicas", filter=Q(replicas__state="ready"))
    ).order_by("name"):
        total, available = node.total_memory_bytes, node.available_memory_bytes
        rows.append(
            {"node": node, "total": total, "used": max(total - available, 0) if available else None}
        )
    return rows


def deployments_by_state() -> list[dict[str, Any]]:
    counts = dict(Deployment.objects.values_list("state").annotate(n=Count("id")))
    return [
        {"state": s, "label": s.label, "count": counts.get(s.value, 0)}
        for s in DeploymentState
        if counts.get(s.value)
    ]


def top_tenants_today(limit: int = 5) -> list[dict[str, Any]]:
    start = timezone.now().astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    rows = (
        UsageRollup.objects.filter(hour__gte=start)
        .values("tenant__slug", "tenant__name", "currency")
        .annotate(
            requests=Sum("requests"),
            prompt=Sum("prompt_tokens"),
            completion=Sum("completion_tokens"),
            cost=Sum("cost"),
        )
    )
    out = [{**r, "tokens": (r["prompt"] or 0) + (r["completion"] or 0)} for r in rows]
    return sorted(out, key=lambda r: r["tokens"], reverse=True)[:limit]


def recent_problems(limit: int = 8) -> dict[str, Any]:
    since = timezone.now() - timedelta(hours=24)
    failed_events = UsageEvent.objects.filter(occurred_at__gte=since).exclude(status="ok")
    return {
        "failed_requests": failed_events.count(),
        "by_status": list(
            failed_events.values("http_status", "status").annotate(n=Count("id")).order_by("-n")[:5]
        ),
        "operations": list(
            Operation.objects.filter(
                status=OperationStatus.FAILED, created_at__gte=since
            ).select_related("deployment")[:limit]
        ),
        "deployments": list(
            Deployment.objects.filter(
                state__in=[DeploymentState.FAILED, DeploymentState.DEGRADED]
            ).select_related("model")
        ),
        "crashed": list(
            Replica.objects.filter(state__in=["crashed", "failed"]).select_related("deployment")[
                :limit
            ]
        ),
        "dead_letters": DeadLetter.objects.filter(received_at__gte=since).count(),
        "unreachable_nodes": list(Node.objects.filter(status="unreachable")),
    }


def replica_metrics(replica: Replica) -> dict[str, Any] | None:
    """The engine's last scraped figures (running/waiting requests, KV cache, mean TTFT)."""
    figures = fleet.read_telemetry(replica.pk)
    if not figures:
        return None
    count = figures.get("ttft_count") or 0
    return {
        **figures,
        "ttft_mean_ms": 1000 * figures.get("ttft_seconds_sum", 0) / count if count else None,
        "age_s": time.time() - figures.get("scraped_at", time.time()),
    }


# What usage is grouped by: a tenant, or a model, its base's usage apart from each adapter's.
USAGE_GROUPS = {
    "tenant": ("tenant__slug",),
    "model": ("model__served_name", "adapter__served_name"),
}


def usage_label(row: dict[str, Any], group: str) -> str:
    """A usage group's name: the tenant, the model, or ``adapter (on model)``."""
    if group == "tenant":
        return row["tenant__slug"]
    adapter = row["adapter__served_name"]
    return f"{adapter} (on {row['model__served_name']})" if adapter else row["model__served_name"]


def usage_series(
    rollups: QuerySet[UsageRollup], group: str, granularity: str, start: datetime, end: datetime
) -> dict[str, Any]:
    """Tokens and cost per time bucket and per tenant or model/adapter, shaped for Chart.js."""
    rows = (
        rollups.annotate(bucket=Trunc("hour", granularity, tzinfo=UTC))
        .values("bucket", *USAGE_GROUPS[group], "currency")
        .annotate(
            prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"), cost=Sum("cost")
        )
        .order_by("bucket")
    )
    step = timedelta(hours=1) if granularity == "hour" else timedelta(days=1)
    labels, cursor = [], start
    while cursor < end and len(labels) < 24 * 62:
        labels.append(cursor)
        cursor += step
    index = {b: i for i, b in enumerate(labels)}
    tokens: dict[str, list[int]] = {}
    cost: dict[str, list[float]] = {}
    currencies = set()
    for r in rows:
        i = index.get(r["bucket"])
        if i is None:
            continue
        name = usage_label(r, group)
        tokens.setdefault(name, [0] * len(labels))[i] += (r["prompt"] or 0) + (r["completion"] or 0)
        cost.setdefault(name, [0.0] * len(labels))[i] += float(r["cost"] or 0)
        currencies.add(r["currency"])
    fmt = "%m-%d %H:00" if granularity == "hour" else "%Y-%m-%d"
    return {
        "labels": [b.strftime(fmt) for b in labels],
        "tokens": [{"label": k, "data": v} for k, v in sorted(tokens.items())],
        "cost": [{"label": k, "data": v} for k, v in sorted(cost.items())],
        "currency": ", ".join(sorted(currencies)) or "",
    }


def totals_by(rollups: QuerySet[UsageRollup], group: str) -> list[dict[str, Any]]:
    """Usage per tenant, or per model with a row for each adapter called on it."""
    fields = USAGE_GROUPS[group]
    return list(
        rollups.values(*fields, "currency")
        .annotate(
            requests=Sum("requests"),
            errors=Sum("errors"),
            prompt=Sum("prompt_tokens"),
            cached=Sum("cached_tokens"),
            completion=Sum("completion_tokens"),
            cost=Sum("cost"),
        )
        .order_by(*[F(f).asc(nulls_first=True) for f in fields], "currency")
    )


def current_price(model: Any, currency: str, adapter: Any = None) -> Price | None:
    """The price in force now: a model's, or an adapter's own (else its base's)."""
    return price_at(model, currency, timezone.now(), adapter=adapter)


def cost_of(price: Price | None, prompt: int, cached: int, completion: int) -> Decimal | None:
    return None if price is None else price.cost(prompt, cached, completion)
