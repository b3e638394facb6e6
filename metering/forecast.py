"""Burn-rate forecasts: at the last 24 hours' rate, when does a quota (a tenant's) or a
budget (a key's) run out?

The rate is what the subject's requests used in the 24 hours before now (usage events, by
when they happened: tokens are prompt + completion, money their priced cost). The used
figure is the one the budget is judged by: the gateway's settled counters for a tenant
(``metering.usage.period_usage``), the database's rollups for a key. The run-out moment is
``now + remaining / rate`` to the microsecond. Each forecast is in one of four states:

- ``runs_out``: at this rate the quota runs out at ``runs_out_at``, within this period;
- ``not_this_period``: at this rate it lasts until the period ends (and resets);
- ``no_usage``: nothing was used in the last 24 hours, so there is no rate to go by;
- ``exhausted``: the quota is used up already.
"""

from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import ROUND_FLOOR, Decimal
from typing import Any

from django.db.models import Q, Sum

from metering.models import UsageEvent, UsageRollup
from metering.periods import period_end, period_id, period_start
from metering.usage import period_usage
from tenants.models import ApiKey, Tenant

WINDOW = timedelta(hours=24)
_WINDOW_US = Decimal(int(WINDOW.total_seconds()) * 1_000_000)

RUNS_OUT = "runs_out"
NOT_THIS_PERIOD = "not_this_period"
NO_USAGE = "no_usage"
EXHAUSTED = "exhausted"
MONEY, TOKENS = "money", "tokens"


@dataclass(frozen=True)
class Forecast:
    """One quota's (or budget's) forecast: ``limit``, ``used`` and ``rate`` (per 24 h) are
    ints for tokens, decimals in ``unit`` (a currency) for money."""

    kind: str
    unit: str
    limit: Decimal | int
    used: Decimal | int
    rate: Decimal | int
    state: str
    runs_out_at: datetime | None
    period_id: str
    period_end: datetime

    @property
    def remaining(self) -> Decimal | int:
        return max(self.limit - self.used, 0)

    def sentence(self) -> str:
        """The forecast in words, for the console and notices."""
        what = "token quota" if self.kind == TOKENS else "money quota"
        if self.state == EXHAUSTED:
            return f"This {what} is used up for {self.period_id}."
        if self.state == NO_USAGE:
            return f"No usage in the last 24 h: no forecast for this {what}."
        rate = f"{self.rate:,} tokens" if self.kind == TOKENS else f"{self.rate:,.2f} {self.unit}"
        if self.state == NOT_THIS_PERIOD:
            return (
                f"At the last 24 h's rate ({rate} a day) this {what} lasts until the period "
                f"ends on {self.period_end:%Y-%m-%d %H:%M} UTC."
            )
        return (
            f"At the last 24 h's rate ({rate} a day) this {what} runs out on "
            f"{self.runs_out_at:%Y-%m-%d %H:%M} UTC."
        )

    def as_dict(self) -> dict[str, Any]:
        """The API's and webhooks' shape: amounts of money as decimal strings."""

        def out(value: Decimal | int) -> str | int:
            return format(value, "f") if isinstance(value, Decimal) else value

        return {
            "quota": self.kind,
            "unit": self.unit,
            "state": self.state,
            "runs_out_at": self.runs_out_at.isoformat() if self.runs_out_at else None,
            "limit": out(self.limit),
            "used": out(self.used),
            "remaining": out(self.remaining),
            "rate_per_day": out(self.rate),
            "window_hours": int(WINDOW.total_seconds() // 3600),
            "period_id": self.period_id,
            "period_end": self.period_end.isoformat(),
            "summary": self.sentence(),
        }


def project(
    kind: str,
    unit: str,
    limit: Decimal | int,
    used: Decimal | int,
    rate: Decimal | int,
    now: datetime,
    period: str,
) -> Forecast:
    """The forecast for ``limit``/``used`` at ``rate`` per 24 hours (a pure function)."""
    end = period_end(period, now)
    remaining = limit - used
    runs_out_at = None
    if remaining <= 0:
        state = EXHAUSTED
    elif rate <= 0:
        state = NO_USAGE
    else:
        micros = (Decimal(remaining) * _WINDOW_US / Decimal(rate)).to_integral_value(ROUND_FLOOR)
        runs_out_at = now + timedelta(microseconds=int(micros)) if micros < 10**17 else end
        state = RUNS_OUT if runs_out_at < end else NOT_THIS_PERIOD
        if state == NOT_THIS_PERIOD:
            runs_out_at = None
    return Forecast(kind, unit, limit, used, rate, state, runs_out_at, period_id(period, now), end)


def burn(events: Q, now: datetime) -> tuple[int, Decimal]:
    """(tokens, money) of the usage events matching ``events`` in the 24 h up to ``now``
    (one exactly 24 h old is outside)."""
    sums = UsageEvent.objects.filter(events, occurred_at__gt=now - WINDOW, occurred_at__lte=now)
    totals = sums.aggregate(p=Sum("prompt_tokens"), c=Sum("completion_tokens"), m=Sum("cost"))
    return (totals["p"] or 0) + (totals["c"] or 0), totals["m"] or Decimal(0)


def key_rows(key: ApiKey) -> Q:
    """A key's usage, with that of the keys Tollgate issued to work for it (a batch job's)."""
    return Q(api_key=key) | Q(api_key__parent=key)


def key_usage(key: ApiKey, now: datetime) -> tuple[int, Decimal]:
    """(tokens, money) the key used this quota period of its tenant (from the rollups)."""
    period = key.tenant.quota_period
    rows = UsageRollup.objects.filter(
        key_rows(key), hour__gte=period_start(period, now), hour__lt=period_end(period, now)
    )
    totals = rows.aggregate(p=Sum("prompt_tokens"), c=Sum("completion_tokens"), m=Sum("cost"))
    return (totals["p"] or 0) + (totals["c"] or 0), totals["m"] or Decimal(0)


def _forecasts(
    limits: dict[str, Decimal | int | None],
    used: tuple[int, Decimal],
    rate: tuple[int, Decimal],
    currency: str,
    now: datetime,
    period: str,
) -> list[Forecast]:
    figures = {TOKENS: ("tokens", used[0], rate[0]), MONEY: (currency, used[1], rate[1])}
    return [
        project(kind, figures[kind][0], limit, figures[kind][1], figures[kind][2], now, period)
        for kind, limit in limits.items()
        if limit is not None
    ]


def tenant_forecasts(tenant: Tenant, now: datetime) -> list[Forecast]:
    """A forecast for each quota the tenant has (money first, then tokens)."""
    limits = {MONEY: tenant.quota_amount, TOKENS: tenant.quota_tokens}
    if all(v is None for v in limits.values()):
        return []
    rate = burn(Q(tenant=tenant), now)
    used = period_usage(tenant, now)
    return _forecasts(limits, used, rate, tenant.currency, now, tenant.quota_period)


def key_forecasts(key: ApiKey, now: datetime) -> list[Forecast]:
    """A forecast for each budget the key has (money first, then tokens)."""
    limits = {MONEY: key.budget_amount, TOKENS: key.budget_tokens}
    if all(v is None for v in limits.values()):
        return []
    tenant = key.tenant
    rate = burn(key_rows(key), now)
    return _forecasts(limits, key_usage(key, now), rate, tenant.currency, now, tenant.quota_period)
