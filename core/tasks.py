"""Queuing Celery tasks by name, so services need not import the tasks modules that call them.

The project's Celery app is made in ``config/celery.py`` (the composition root) and is the
current app of every Tollgate process; this module reaches it as ``celery.current_app``.
"""

from functools import cache
from typing import Any

from celery import current_app


def enqueue(name: str, *args: Any, queue: str, **options: Any) -> None:
    """Queue the task registered as ``name`` on ``queue``.

    By name, so services need not import the tasks module that calls them (it imports
    them). The apps' task modules are imported once here, as a worker does at start, so
    the name finds the task object itself: its options and tests' eager mode apply, and
    the message is the one ``task.apply_async`` sends. An unknown name is a KeyError.
    """
    discover_tasks()
    current_app.tasks[name].apply_async(args=list(args), queue=queue, **options)


@cache
def discover_tasks() -> None:
    """Import the installed apps' ``tasks`` modules (once): their tasks are registered then.

    Only those modules: the worker's full start would also run Django's system checks in
    this process.
    """
    current_app.autodiscover_tasks(force=True)
