"""Celery beat entries of the alerts app (merged into CELERY_BEAT_SCHEDULE)."""

BEAT_SCHEDULE: dict[str, dict] = {
    # Webhook attempts that are due: retries past their back-off, and any attempt a
    # restarted worker dropped.
    "alerts-deliver-due": {"task": "alerts.deliver_due", "schedule": 15.0},
}
