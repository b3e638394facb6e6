"""Quota periods: which period a moment falls in, its bounds and its stable id."""

from datetime import UTC, datetime, timedelta

from tenants.choices import QuotaPeriod


def period_start(period: str, at: datetime) -> datetime:
    """Start (UTC, inclusive) of the period containing ``at``."""
    at = at.astimezone(UTC)
    day = at.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == QuotaPeriod.DAILY:
        return day
    if period == QuotaPeriod.WEEKLY:
        return day - timedelta(days=day.weekday())
    if period == QuotaPeriod.MONTHLY:
        return day.replace(day=1)
    raise ValueError(f"unknown quota period {period!r}")


def period_end(period: str, at: datetime) -> datetime:
    """End (UTC, exclusive) of the period containing ``at``."""
    start = period_start(period, at)
    if period == QuotaPeriod.DAILY:
        return start + timedelta(days=1)
    if period == QuotaPeriod.WEEKLY:
        return start + timedelta(days=7)
    return (start + timedelta(days=32)).replace(day=1)


def period_id(period: str, at: datetime) -> str:
    """A stable name for the period containing ``at``: 2026-11-26, 2026-W48 or 2026-11."""
    start = period_start(period, at)
    if period == QuotaPeriod.DAILY:
        return start.strftime("%Y-%m-%d")
    if period == QuotaPeriod.WEEKLY:
        year, week, _ = start.isocalendar()
        return f"{year}-W{week:02d}"
    return start.strftime("%Y-%m")
