"""Celery tasks of alerts: thin wrappers around the delivery rules."""

from celery import shared_task

from alerts import delivery


@shared_task(name="alerts.deliver_webhook")
def deliver_webhook(delivery_id: str) -> str:
    """Make a delivery's due attempt (a no-op when it is not due); returns its status."""
    row = delivery.attempt(delivery_id)
    return row.status if row is not None else "not due"


@shared_task(name="alerts.deliver_due")
def deliver_due() -> int:
    """Beat's pass: attempts that are due, whether or not a queued task still holds them
    (a worker restart loses countdowns; a delivery never depends on one)."""
    return delivery.deliver_due()
