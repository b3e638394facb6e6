"""Run the usage consumer: Redis stream → PostgreSQL, until stopped (SIGTERM/SIGINT)."""

import signal
from typing import Any

from django.core.management.base import BaseCommand

from metering import ingest


class Command(BaseCommand):
    help = "Ingest usage events from the Redis stream into PostgreSQL until stopped."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--name", default="", help="Consumer name (default hostname-pid).")
        parser.add_argument("--batch", type=int, default=1000, help="Entries per batch.")
        parser.add_argument("--block-ms", type=int, default=1000, help="Wait for new entries.")
        parser.add_argument(
            "--claim-idle-ms",
            type=int,
            default=30_000,
            help="Take over another consumer's entries pending longer than this.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        stopping = False

        def stop(signum: int, frame: Any) -> None:
            nonlocal stopping
            stopping = True  # finish (commit and ack) the batch in hand, then leave

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        ingest.run_consumer(
            options["name"] or ingest.consumer_name(),
            count=options["batch"],
            block_ms=options["block_ms"],
            claim_idle_ms=options["claim_idle_ms"],
            stop=lambda: stopping,
        )
