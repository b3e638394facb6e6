"""Celery beat entries of the metering app (merged into CELERY_BEAT_SCHEDULE)."""

BEAT_SCHEDULE: dict[str, dict] = {
    # Safety net beside the consume_usage service: drains whatever it left.
    "metering-ingest-usage": {"task": "metering.ingest_usage", "schedule": 30.0},
    "metering-trim-usage-stream": {"task": "metering.trim_usage_stream", "schedule": 300.0},
    # Every minute, so a period roll-over is reconciled within a minute of midnight.
    "metering-reconcile-quotas": {"task": "metering.reconcile_quotas", "schedule": 60.0},
    "metering-close-periods": {"task": "metering.close_periods", "schedule": 3600.0},
}


def budget_schedule(seconds: float) -> dict[str, dict]:
    """Budget thresholds (tenant quotas and key budgets) checked every ``seconds``."""
    return {"metering-check-budgets": {"task": "metering.check_budgets", "schedule": seconds}}


def engine_ledger_schedule(seconds: float) -> dict[str, dict]:
    """The bill checked against every engine's own counters every ``seconds``
    (metering/engine_ledger.py); a run that could not start in time is skipped."""
    return {
        "metering-check-engines": {
            "task": "metering.check_engines",
            "schedule": seconds,
            "options": {"expires": seconds * 2},
        }
    }
