"""Celery tasks keep their database connection between tasks, as Django keeps one between
requests: reused while younger than CONN_MAX_AGE and healthy, replaced otherwise."""

import time
from collections.abc import Iterator

import pytest
from celery import Task
from celery.fixups.django import DjangoWorkerFixup
from celery.signals import beat_embedded_init, task_postrun, task_prerun, worker_process_init
from django.db import connection
from psycopg import connect

from config.celery import app
from gateway.tasks import tune_admission
from tests.databases import database_url

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def worker_fixup() -> Iterator[DjangoWorkerFixup]:
    """Celery's Django fixup with the signal handlers a worker installs; removed afterwards."""
    fixup = DjangoWorkerFixup(app).install()
    yield fixup
    task_prerun.disconnect(fixup.on_task_prerun)
    task_postrun.disconnect(fixup.on_task_postrun)
    beat_embedded_init.disconnect(fixup.close_database)
    worker_process_init.disconnect(fixup.on_worker_process_init)


def backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def run_task(task: Task) -> int:
    """What a worker's tracer signals around a task; the task's body asks for its backend."""
    task_prerun.send(sender=task, task_id="t", task=task, args=(), kwargs={})
    pid = backend_pid()
    task_postrun.send(
        sender=task, task_id="t", task=task, args=(), kwargs={}, retval=None, state="SUCCESS"
    )
    return pid


def test_consecutive_tasks_share_one_session(worker_fixup: DjangoWorkerFixup) -> None:
    pids = {run_task(tune_admission) for _ in range(5)}
    assert len(pids) == 1


def test_a_connection_older_than_conn_max_age_is_replaced(worker_fixup: DjangoWorkerFixup) -> None:
    first = run_task(tune_admission)
    connection.close_at = time.monotonic() - 1  # CONN_MAX_AGE has passed
    assert run_task(tune_admission) != first


def test_a_dead_connection_is_replaced_before_the_next_task(
    worker_fixup: DjangoWorkerFixup,
) -> None:
    first = run_task(tune_admission)
    with connect(database_url(), autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [first])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the server ends the backend asynchronously
        with connect(database_url(), autocommit=True) as other:
            alive = other.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [first])
            if alive.fetchone() is None:
                break
        time.sleep(0.05)
    assert run_task(tune_admission) != first
