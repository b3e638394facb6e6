"""``manage.py db_roles``: create/refresh the least-privilege PostgreSQL roles
(config/dbroles.py): the gateway's and, with ``--app-role``, the application role of web,
the worker, the batch runner and the usage consumer. Run as the database's owner."""

from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand

from config.dbroles import ensure_app_role, ensure_gateway_role


def read_password(path: str | None) -> str | None:
    return Path(path).read_text().strip() if path else None


class Command(BaseCommand):
    help = (
        "Create or refresh the gateway's least-privilege PostgreSQL role and, with --app-role, "
        "the role that writes rows but never the schema (run as the owner)."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--gateway-role", default="tollgate_gateway")
        parser.add_argument(
            "--password-file", help="the gateway role's password (first line); omitted: unchanged"
        )
        parser.add_argument(
            "--app-role",
            help="also the application role (web, worker, batches, usage), e.g. tollgate_app",
        )
        parser.add_argument(
            "--app-password-file", help="the application role's password; omitted: unchanged"
        )

    def handle(
        self,
        *args: Any,
        gateway_role: str,
        password_file: str | None,
        app_role: str | None,
        app_password_file: str | None,
        **kw: Any,
    ) -> None:
        ensure_gateway_role(gateway_role, read_password(password_file))
        self.stdout.write(f"role {gateway_role}: read everything, write batches and key use")
        if app_role:
            ensure_app_role(app_role, read_password(app_password_file))
            self.stdout.write(f"role {app_role}: read and write rows, never the schema")
