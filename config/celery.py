"""The Celery application shared by the worker, beat and the web process (to queue tasks)."""

import os
from typing import Any

from celery import Celery, Task
from celery.signals import task_postrun, task_prerun

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("tollgate")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@task_prerun.connect
@task_postrun.connect
def close_old_connections(sender: Task | None = None, **kwargs: Any) -> None:
    """Around each task, what Django does around each request: a connection older than
    CONN_MAX_AGE, or broken by an error, is closed; a good one is kept for the next task.

    Celery's own fixup would close it after every task (CELERY_DB_REUSE_MAX unset): each of
    beat's periodic tasks then paid for a new PostgreSQL session (a backend process forked
    and its catalogue caches filled, ~6 ms of server CPU, ~3.5 ms in the worker), about
    one a second at idle, on the cores the gateway serves from. Eager tasks (tests) run
    inside the caller's transaction: left alone, as the fixup leaves them.
    """
    if sender is not None and getattr(sender.request, "is_eager", False):
        return
    from django.db import close_old_connections as close_old

    close_old()
