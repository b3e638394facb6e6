"""``manage.py db_roles``: create/refresh the gateway's PostgreSQL role (config/dbroles.py)."""

from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand

from config.dbroles import ensure_gateway_role


class Command(BaseCommand):
    help = "Create or refresh the gateway's least-privilege PostgreSQL role (run as the owner)."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--gateway-role", default="tollgate_gateway")
        parser.add_argument(
            "--password-file", help="the role's password (first line); omitted: unchanged"
        )

    def handle(self, *args: Any, gateway_role: str, password_file: str | None, **kw: Any) -> None:
        password = Path(password_file).read_text().strip() if password_file else None
        ensure_gateway_role(gateway_role, password)
        self.stdout.write(f"role {gateway_role}: read everything, write batches and key use")
