"""Celery beat entries of the batches app (to merge into CELERY_BEAT_SCHEDULE)."""

BEAT_SCHEDULE: dict[str, dict] = {
    # Picks up batches whose runner died: its lease (TOLLGATE_BATCH_LEASE_SECONDS) ran out.
    "batches-recover": {"task": "batches.recover_batches", "schedule": 60.0},
    "batches-purge-expired-files": {"task": "batches.purge_expired_files", "schedule": 3600.0},
}
