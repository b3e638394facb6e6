"""Celery beat entries of the gateway app (merged into CELERY_BEAT_SCHEDULE)."""

BEAT_SCHEDULE: dict[str, dict] = {
    "gateway-tune-admission": {"task": "gateway.tune_admission", "schedule": 5.0},
    "gateway-reap-orphans": {"task": "gateway.reap_orphans", "schedule": 10.0},
    # Redis holds kept responses meanwhile (TOLLGATE_RESPONSES_CACHE_SECONDS).
    "gateway-persist-responses": {"task": "gateway.persist_responses", "schedule": 5.0},
    # PostgreSQL keeps them TOLLGATE_RESPONSES_RETENTION_DAYS.
    "gateway-expire-responses": {"task": "gateway.expire_responses", "schedule": 3600.0},
}
