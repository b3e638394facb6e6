"""Budget alerts: a tenant's quotas and its keys' budgets checked against the tenant's
thresholds (50, 80 and 100 % by default), each threshold firing once per period.

A tenant's used figure is the gateway's (``metering.usage.period_usage``); a key's comes
from the rollups, its Tollgate-issued child keys' included. A key's budget only warns: the
tenant's quota is what stops requests. Each (subject, quota kind, threshold, period) fires
through ``alerts.services.raise_alert`` with its own dedupe key, so checks running twice,
or at the same time, fire it once; thresholds crossed together (a big job jumping from 40 %
to 100 %) fire each in order. A quota raised mid-period does not make a threshold that
fired in that period fire again, even if usage falls below it and climbs past it again.
"""

import logging
from datetime import datetime
from decimal import Decimal

from django.db.models import Q
from django.utils import timezone

from alerts.choices import Event, Severity
from alerts.models import Notice
from alerts.services import raise_alert
from metering import forecast
from metering.periods import period_end, period_id, period_start
from metering.usage import period_usage
from tenants.choices import TenantStatus
from tenants.models import ApiKey, Tenant

log = logging.getLogger(__name__)


def crossed(thresholds: list[int], used: Decimal | int, limit: Decimal | int) -> list[int]:
    """The thresholds (percentages, ascending) that ``used`` has reached of ``limit``."""
    if limit is None or limit <= 0:
        return []
    return [t for t in sorted(thresholds) if used * 100 >= t * limit]


def dedupe_key(period: str, subject: str, pk: int, kind: str, threshold: int) -> str:
    return f"budget:{period}:{subject}:{pk}:{kind}:{threshold}"


def check_budgets(now: datetime | None = None) -> int:
    """Check every active tenant's quotas and keys' budgets; returns how many alerts fired."""
    now = now or timezone.now()
    tenants = Tenant.objects.filter(status=TenantStatus.ACTIVE).exclude(alert_thresholds=[])
    quota = Q(quota_tokens__isnull=False) | Q(quota_amount__isnull=False)
    fired = sum(check_tenant(tenant, now) for tenant in tenants.filter(quota))
    budget = Q(budget_tokens__isnull=False) | Q(budget_amount__isnull=False)
    keys = ApiKey.objects.usable().filter(budget, parent=None).select_related("tenant")
    fired += sum(check_key(key, now) for key in keys.filter(tenant__in=tenants))
    return fired


def check_tenant(tenant: Tenant, now: datetime) -> int:
    tokens, money = period_usage(tenant, now)
    limits = {
        forecast.MONEY: (tenant.quota_amount, money),
        forecast.TOKENS: (tenant.quota_tokens, tokens),
    }
    return _check(tenant, None, limits, now)


def check_key(key: ApiKey, now: datetime) -> int:
    tokens, money = forecast.key_usage(key, now)
    limits = {
        forecast.MONEY: (key.budget_amount, money),
        forecast.TOKENS: (key.budget_tokens, tokens),
    }
    return _check(key.tenant, key, limits, now)


def _check(tenant: Tenant, key: ApiKey | None, limits: dict, now: datetime) -> int:
    period = period_id(tenant.quota_period, now)
    subject, pk = ("key", key.pk) if key else ("tenant", tenant.pk)
    due = {
        dedupe_key(period, subject, pk, kind, t): (kind, t)
        for kind, (limit, used) in limits.items()
        for t in crossed(tenant.alert_thresholds, used, limit)
    }
    if not due:
        return 0
    done = set(Notice.objects.filter(dedupe_key__in=due).values_list("dedupe_key", flat=True))
    unfired = [(key_, kind, t) for key_, (kind, t) in due.items() if key_ not in done]
    if not unfired:
        return 0
    forecasts = {
        f.kind: f
        for f in (
            forecast.key_forecasts(key, now) if key else forecast.tenant_forecasts(tenant, now)
        )
    }
    fired = 0
    for key_, kind, threshold in sorted(unfired, key=lambda item: (item[1], item[2])):
        limit, used = limits[kind]
        notice = _fire(tenant, key, kind, threshold, limit, used, forecasts.get(kind), now, key_)
        fired += notice is not None
    return fired


def _amount(kind: str, value: Decimal | int, unit: str) -> str:
    if kind == forecast.TOKENS:
        return f"{value:,} tokens"
    return f"{value:,.2f} {unit}"


def _fire(
    tenant: Tenant,
    key: ApiKey | None,
    kind: str,
    threshold: int,
    limit: Decimal | int,
    used: Decimal | int,
    outlook: forecast.Forecast | None,
    now: datetime,
    dedupe: str,
) -> Notice | None:
    unit = tenant.currency if kind == forecast.MONEY else "tokens"
    period = tenant.quota_period
    what = f"{kind} quota" if key is None else f"{kind} budget"
    who = tenant.name if key is None else f"Key {key.name} ({key.masked}) of {tenant.name}"
    figures = f"{_amount(kind, used, unit)} of {_amount(kind, limit, unit)}"
    title = f"{who} used {threshold} % of its {what}"
    detail = f"{figures} in {period_id(period, now)}."
    if outlook is not None:
        detail += " " + outlook.sentence()
    if key is not None:
        detail += " A key's budget only warns: the tenant's quota is what stops requests."
    payload = {
        "subject": "key" if key else "tenant",
        "tenant": {"id": tenant.pk, "slug": tenant.slug, "name": tenant.name},
        "key": None if key is None else {"id": key.pk, "name": key.name, "prefix": key.masked},
        "quota": kind,
        "threshold": threshold,
        "used": format(used, "f") if kind == forecast.MONEY else used,
        "limit": format(limit, "f") if kind == forecast.MONEY else limit,
        "unit": unit,
        "period": {
            "kind": period,
            "id": period_id(period, now),
            "start": period_start(period, now).isoformat(),
            "end": period_end(period, now).isoformat(),
        },
        "forecast": outlook.as_dict() if outlook is not None else None,
    }
    return raise_alert(
        Event.BUDGET_THRESHOLD,
        title=title,
        detail=detail,
        payload=payload,
        tenant=tenant,
        severity=Severity.CRITICAL if threshold >= 100 else Severity.WARNING,
        dedupe_key=dedupe,
    )
