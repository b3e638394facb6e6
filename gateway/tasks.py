"""Celery tasks of the gateway app (thin wrappers over gateway.tuning)."""

from celery import shared_task

from gateway import orphans, response_store, tuning


@shared_task(name="gateway.tune_admission", ignore_result=True)
def tune_admission() -> int:
    """Adjust every model's concurrency ceiling from its engines' telemetry."""
    return tuning.tune_all()


@shared_task(name="gateway.reap_orphans", ignore_result=True)
def reap_orphans() -> int:
    """Bill and release requests whose gateway process died mid-flight."""
    return orphans.reap()


@shared_task(name="gateway.persist_responses", ignore_result=True)
def persist_responses(seconds: float = 20.0) -> int:
    """Write kept /v1/responses answers (and deletions) from Redis to PostgreSQL."""
    return response_store.persist(response_store.consumer_name(), seconds)


@shared_task(name="gateway.expire_responses", ignore_result=True)
def expire_responses() -> int:
    """Delete kept responses older than TOLLGATE_RESPONSES_RETENTION_DAYS."""
    return response_store.expire()
