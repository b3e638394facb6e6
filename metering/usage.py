"""Usage summaries for a tenant or key over a time range, and quota left this period."""

from datetime import datetime
from decimal import Decimal
from typing import Any

from django.db.models import F, QuerySet, Sum
from django.db.models.functions import TruncDay

from core.keyspace import quota_key
from core.pricing import from_nano
from core.redis import get_redis
from metering.models import UsageRollup
from metering.periods import period_end, period_id, period_start
from tenants.models import ApiKey, Tenant

_SUMS = {
    n: Sum(n) for n in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost")
}


def _figures(sums: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = sums.get("prompt_tokens") or 0, sums.get("completion_tokens") or 0
    return {
        "requests": sums.get("requests") or 0,
        "prompt_tokens": prompt,
        "cached_tokens": sums.get("cached_tokens") or 0,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "cost": format(sums.get("cost") or Decimal(0), "f"),
    }


def rollups_between(tenant: Tenant, start: datetime, end: datetime) -> QuerySet[UsageRollup]:
    """The tenant's hourly rollups from ``start`` to ``end`` (hours that begin in range)."""
    return UsageRollup.objects.filter(tenant=tenant, hour__gte=start, hour__lt=end)


def summary(qs: QuerySet[UsageRollup]) -> dict[str, Any]:
    return _figures(qs.aggregate(**_SUMS))


def breakdown(qs: QuerySet[UsageRollup], group_by: str) -> list[dict[str, Any]]:
    """Usage per model and adapter (``model``: a row for the base model itself and one per
    adapter called on it, ``adapter`` null on the first) or per UTC day (``day``)."""
    if group_by == "model":
        names = ("model__served_name", "adapter__served_name")
        base_first = F("adapter__served_name").asc(nulls_first=True)
        rows = qs.values(*names).annotate(**_SUMS).order_by("model__served_name", base_first)
        return [
            {"model": r["model__served_name"], "adapter": r["adapter__served_name"], **_figures(r)}
            for r in rows
        ]
    rows = qs.annotate(day=TruncDay("hour")).values("day").annotate(**_SUMS).order_by("day")
    return [{"day": r["day"].date().isoformat(), **_figures(r)} for r in rows]


def period_usage(tenant: Tenant, now: datetime) -> tuple[int, Decimal]:
    """(tokens, money) the tenant used this quota period: what the gateway enforces (its
    Redis counters of settled requests, reconciled from PostgreSQL), or the database's
    figure when the counters do not exist."""
    key = quota_key(tenant.pk, period_id(tenant.quota_period, now))
    raw = get_redis().hmget(key, "tokens_used", "money_used")
    if raw[0] is not None and raw[1] is not None:
        return int(raw[0]), from_nano(int(raw[1]))
    start, end = period_start(tenant.quota_period, now), period_end(tenant.quota_period, now)
    db = summary(rollups_between(tenant, start, end))
    tokens_used = int(raw[0]) if raw[0] is not None else db["total_tokens"]
    money_used = from_nano(int(raw[1])) if raw[1] is not None else Decimal(db["cost"])
    return tokens_used, money_used


def quota_status(tenant: Tenant, now: datetime) -> dict[str, Any]:
    """The tenant's quota this period: limit, used and remaining, tokens and money
    (``period_usage``)."""
    start, end = period_start(tenant.quota_period, now), period_end(tenant.quota_period, now)
    tokens_used, money_used = period_usage(tenant, now)
    amount = tenant.quota_amount
    return {
        "period": tenant.quota_period,
        "period_id": period_id(tenant.quota_period, now),
        "period_start": start.isoformat(),
        "period_end": end.isoformat(),
        "tokens": tenant.quota_tokens,
        "tokens_used": tokens_used,
        "tokens_remaining": None
        if tenant.quota_tokens is None
        else max(tenant.quota_tokens - tokens_used, 0),
        "amount": None if amount is None else format(amount, "f"),
        "amount_used": format(money_used.normalize() if money_used else Decimal(0), "f"),
        "amount_remaining": None if amount is None else format(max(amount - money_used, 0), "f"),
        "currency": tenant.currency,
    }


def self_service(
    key: ApiKey, start: datetime, end: datetime, group_by: str | None, now: datetime
) -> dict[str, Any]:
    """What ``GET /v1/usage`` answers for a key: its and its tenant's usage and quota."""
    tenant = key.tenant
    tenant_rows = rollups_between(tenant, start, end)
    key_rows = tenant_rows.filter(api_key=key)
    body = {
        "object": "usage",
        "tenant": tenant.slug,
        "key": {"name": key.name, "prefix": key.prefix},
        "start": start.isoformat(),
        "end": end.isoformat(),
        "currency": tenant.currency,
        "key_usage": summary(key_rows),
        "tenant_usage": summary(tenant_rows),
        "quota": quota_status(tenant, now),
    }
    if group_by:
        body["group_by"] = group_by
        body["data"] = breakdown(key_rows, group_by)
    return body
