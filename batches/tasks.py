"""Celery tasks of the Batch API: thin wrappers around the runner and services."""

from celery import shared_task

from batches import runner, services


@shared_task(name=services.RUN_TASK, acks_late=True)
def run_batch(batch_pk: int) -> str:
    """Run a batch; a second delivery finds it claimed and does nothing."""
    return runner.run_batch(batch_pk)


@shared_task(name="batches.recover_batches")
def recover_batches() -> list[int]:
    """Queue again the batches no runner holds (lost task, killed worker)."""
    return runner.recover()


@shared_task(name="batches.purge_expired_files")
def purge_expired_files() -> int:
    return services.purge_expired_files()
