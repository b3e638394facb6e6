"""The Celery application shared by the worker, beat and the web process (to queue tasks)."""

import os
from functools import cache
from typing import Any

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("tollgate")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def enqueue(name: str, *args: Any, queue: str, **options: Any) -> None:
    """Queue the task registered as ``name`` on ``queue``.

    By name, so services need not import the tasks module that calls them (it imports
    them). The apps' task modules are imported once here, as a worker does at start, so
    the name finds the task object itself: its options and tests' eager mode apply, and
    the message is the one ``task.apply_async`` sends. An unknown name is a KeyError.
    """
    _discover_tasks()
    app.tasks[name].apply_async(args=list(args), queue=queue, **options)


@cache
def _discover_tasks() -> None:
    # Only the installed apps' tasks modules: the worker's full start would also run
    # Django's system checks in this process.
    app.autodiscover_tasks(force=True)
