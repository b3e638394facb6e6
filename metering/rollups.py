"""Hourly rollups and adjustments, their rebuild from events, and closing billing periods.

Ingestion adds each newly stored event to its hour's rollup in the same transaction, so
rollups always agree with events. A closed period is frozen: ingestion books late events
for it as adjustment lines in the first open period instead, and rebuilds never touch it.

Ingestion holds a shared advisory lock for its transaction and closing (and rebuilding)
an exclusive one, so no batch can write into a period while it is being closed.
"""

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.db.models import Max, Sum
from django.utils import timezone

from metering.models import ClosedPeriod, UsageAdjustment, UsageEvent, UsageRollup
from tenants.audit import Actor

# Advisory lock id ("tgme"): ingestion takes it shared, close and rebuild exclusive.
FREEZE_LOCK = 0x74676D65

_COUNTS = """count(*), count(*) FILTER (WHERE status = 'error'), sum(prompt_tokens),
    sum(cached_tokens), sum(completion_tokens), sum(reasoning_tokens), sum(cost),
    coalesce(sum(prompt_tokens) FILTER (WHERE prompt_estimated), 0)"""
_COUNT_COLUMNS = (
    "requests, errors, prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens, cost, "
    "estimated_prompt_tokens"
)
_ADD_COUNTS = ", ".join(
    f"{c} = t.{c} + EXCLUDED.{c}" for c in [c.strip() for c in _COUNT_COLUMNS.split(",")]
)
_HOUR = "date_trunc('hour', occurred_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'"

# An adapter's usage is its own bucket beside its base model's (adapter_id NULL: the base).
ROLLUP_SQL = f"""
INSERT INTO metering_usagerollup AS t (hour, tenant_id, api_key_id, model_id, adapter_id,
    deployment_id, price_id, currency, {_COUNT_COLUMNS})
SELECT {_HOUR}, tenant_id, api_key_id, model_id, adapter_id, deployment_id, price_id, currency,
    {_COUNTS}
FROM metering_usageevent WHERE adjustment_hour IS NULL AND {{where}}
GROUP BY 1, 2, 3, 4, 5, 6, 7, 8 ORDER BY 1, 2, 3, 4, 5, 6, 7, 8
ON CONFLICT ON CONSTRAINT rollup_unique_bucket_priced DO UPDATE SET {_ADD_COUNTS}
"""
ADJUSTMENT_SQL = f"""
INSERT INTO metering_usageadjustment AS t (hour, usage_hour, tenant_id, api_key_id, model_id,
    adapter_id, deployment_id, price_id, currency, {_COUNT_COLUMNS})
SELECT adjustment_hour, {_HOUR}, tenant_id, api_key_id, model_id, adapter_id, deployment_id,
    price_id, currency, {_COUNTS}
FROM metering_usageevent WHERE adjustment_hour IS NOT NULL AND {{where}}
GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9 ORDER BY 1, 2, 3, 4, 5, 6, 7, 8, 9
ON CONFLICT ON CONSTRAINT adjustment_unique_bucket DO UPDATE SET {_ADD_COUNTS}
"""


def hour_of(at: datetime) -> datetime:
    return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def month_start(at: datetime) -> datetime:
    return hour_of(at).replace(day=1, hour=0)


def next_month(start: datetime) -> datetime:
    return (start + timedelta(days=32)).replace(day=1)


def frozen_before() -> datetime | None:
    """Everything before this moment is in a closed period (None: nothing closed yet)."""
    return ClosedPeriod.objects.aggregate(end=Max("end"))["end"]


def lock_shared() -> None:
    """Called inside an ingestion transaction: closing waits until it commits."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock_shared(%s)", [FREEZE_LOCK])


def _lock_exclusive() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [FREEZE_LOCK])


def add_events(event_ids: list[int]) -> None:
    """Add newly stored events to their rollups or adjustment lines (same transaction)."""
    if not event_ids:
        return
    with connection.cursor() as cursor:
        for sql in (ROLLUP_SQL, ADJUSTMENT_SQL):
            cursor.execute(sql.format(where="id = ANY(%s)"), [event_ids])


@transaction.atomic
def rebuild_rollups(start: datetime, end: datetime) -> tuple[int, int]:
    """Recompute rollups and adjustment lines of the open hours in [start, end) from events.

    Closed periods are frozen and skipped. Returns (rollup rows, adjustment rows) written.
    """
    _lock_exclusive()
    horizon = frozen_before()
    start = max(hour_of(start), horizon) if horizon else hour_of(start)
    if start >= end:
        return 0, 0
    UsageRollup.objects.filter(hour__gte=start, hour__lt=end).delete()
    UsageAdjustment.objects.filter(hour__gte=start, hour__lt=end).delete()
    with connection.cursor() as cursor:
        cursor.execute(
            ROLLUP_SQL.format(where="occurred_at >= %s AND occurred_at < %s"), [start, end]
        )
        rollups = cursor.rowcount
        cursor.execute(
            ADJUSTMENT_SQL.format(where="adjustment_hour >= %s AND adjustment_hour < %s"),
            [start, end],
        )
        return rollups, cursor.rowcount


def _totals(start: datetime, end: datetime) -> dict[str, dict[str, Any]]:
    totals: dict[str, dict[str, Any]] = {}
    for source in (
        UsageRollup.objects.filter(hour__gte=start, hour__lt=end),
        UsageAdjustment.objects.filter(hour__gte=start, hour__lt=end),
    ):
        rows = source.values("currency").annotate(
            r=Sum("requests"), p=Sum("prompt_tokens"), c=Sum("completion_tokens"), m=Sum("cost")
        )
        for row in rows:
            t = totals.setdefault(row["currency"], {"requests": 0, "tokens": 0, "cost": "0"})
            t["requests"] += row["r"]
            t["tokens"] += row["p"] + row["c"]
            t["cost"] = str(Decimal(t["cost"]) + row["m"])
    return totals


@transaction.atomic
def close_period(actor: Actor, start: datetime) -> ClosedPeriod:
    """Close the UTC month starting at ``start``: its rollups and exports are frozen for good.

    Months close in order and only once they have ended; late events for them become
    adjustment lines in the first open month.
    """
    start = month_start(start)
    end = next_month(start)
    if end > timezone.now():
        raise ValidationError({"period": f"{start:%Y-%m} has not ended yet."})
    _lock_exclusive()
    horizon = frozen_before()
    if horizon is not None and start != horizon:
        raise ValidationError(
            {"period": f"Close periods in order: the next one to close starts {horizon:%Y-%m}."}
        )
    user = actor if actor is not None and actor.is_authenticated else None
    return ClosedPeriod.objects.create(
        start=start, end=end, closed_by=user, totals=_totals(start, end)
    )


def close_due_periods(grace: timedelta, now: datetime | None = None) -> list[ClosedPeriod]:
    """Close every month that ended more than ``grace`` ago (the beat job)."""
    now = now or timezone.now()
    horizon = frozen_before()
    if horizon is None:
        first = UsageEvent.objects.order_by("occurred_at").values_list("occurred_at", flat=True)
        oldest = first.first()
        if oldest is None:
            return []
        horizon = month_start(oldest)
    closed = []
    while next_month(horizon) + grace <= now:
        closed.append(close_period(None, horizon))
        horizon = next_month(horizon)
    return closed
