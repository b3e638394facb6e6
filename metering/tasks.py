"""Celery tasks of metering: thin wrappers around the services."""

from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from metering import budgets, engine_ledger, ingest, reconcile, rollups


@shared_task(name="metering.ingest_usage")
def ingest_usage(seconds: float = 20.0) -> int:
    """Drain the usage stream for up to ``seconds`` (also claims a dead consumer's entries).

    The appliance runs ``manage.py consume_usage`` as its own service; this beat task is
    the safety net that keeps events flowing if that service is down.
    """
    return ingest.drain(ingest.consumer_name(), seconds)


@shared_task(name="metering.trim_usage_stream")
def trim_usage_stream() -> int:
    return ingest.trim_stream()


@shared_task(name="metering.reconcile_quotas")
def reconcile_quotas() -> dict[str, int]:
    results = reconcile.reconcile_all()
    counts: dict[str, int] = {}
    for result in results:
        counts[result.status] = counts.get(result.status, 0) + 1
    return counts


@shared_task(name="metering.rebuild_rollups")
def rebuild_rollups(hours: int = 3) -> tuple[int, int]:
    """Recompute the last ``hours`` hours of rollups from events (a cheap self-check)."""
    now = timezone.now()
    return rollups.rebuild_rollups(now - timedelta(hours=hours), now + timedelta(hours=1))


@shared_task(name="metering.close_periods")
def close_periods() -> list[str]:
    grace = timedelta(hours=getattr(settings, "TOLLGATE_PERIOD_CLOSE_GRACE_HOURS", 72))
    return [str(p) for p in rollups.close_due_periods(grace)]


@shared_task(name="metering.check_budgets", ignore_result=True)
def check_budgets() -> int:
    """Fire budget alerts for thresholds crossed this period (each once); returns how many."""
    return budgets.check_budgets()


@shared_task(name="metering.check_engines", ignore_result=True)
def check_engines() -> int:
    """Compare each ready replica's billed tokens with its engine's counters."""
    return engine_ledger.check_all()
