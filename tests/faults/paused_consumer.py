"""Runs the usage consumer (``manage.py consume_usage``) with a pause inside each batch's
transaction, after the batch's events and rollups are written and before the commit, so a
test can kill it there. The pause is patched in here; the product has no such hook.

    python -m tests.faults.paused_consumer SECONDS [consume_usage options]

Each pause prints ``pausing before commit`` (flushed) first, for tests to wait on.
"""

import os
import sys
import time
from typing import Any
from unittest import mock


def main() -> None:
    seconds, options = float(sys.argv[1]), sys.argv[2:]
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()
    from django.core.management import call_command

    from metering import rollups

    add_events = rollups.add_events

    def add_then_pause(ids: list[int]) -> Any:
        # metering.ingest.store calls this inside its transaction, after inserting the events.
        result = add_events(ids)
        print(f"pausing before commit for {seconds:.1f}s", flush=True)
        time.sleep(seconds)
        return result

    with mock.patch.object(rollups, "add_events", add_then_pause):
        call_command("consume_usage", *options)


if __name__ == "__main__":
    main()
