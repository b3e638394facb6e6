"""Celery beat entries of the metering app (merged into CELERY_BEAT_SCHEDULE)."""

BEAT_SCHEDULE: dict[str, dict] = {}
