"""Every beat entry of metering names a task that exists."""

from config.celery import app
from metering.schedule import BEAT_SCHEDULE


def test_every_beat_entry_names_a_registered_task() -> None:
    import metering.tasks  # noqa: F401 - registers the tasks, as the worker's autodiscovery does

    assert BEAT_SCHEDULE
    for entry in BEAT_SCHEDULE.values():
        assert entry["task"] in app.tasks, entry["task"]
