"""Issue an admin API token for a user from the command line (automation, CI, first setup)."""

from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from tenants import services


class Command(BaseCommand):
    help = (
        "Issue an admin API token (tga-…) for an existing user and print it once. "
        "Only its prefix and an HMAC hash are stored."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--user", required=True, help="Username the token acts as.")
        parser.add_argument("--name", default="cli", help="A label for the token.")
        parser.add_argument("--days", type=int, default=None, help="Expire after this many days.")

    def handle(self, *args: Any, **options: Any) -> None:
        user = get_user_model().objects.filter(username=options["user"], is_active=True).first()
        if user is None:
            raise CommandError(f"No active user {options['user']!r}.")
        expires = timezone.now() + timedelta(days=options["days"]) if options["days"] else None
        issued = services.issue_admin_token(user, options["name"], expires_at=expires)
        self.stdout.write(issued.plaintext)
