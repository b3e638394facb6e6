"""First-start setup: the first platform admin and the local node. Safe to run every start.

It spans the apps (a tenants user, a deployments node), so it lives with the composition root.
"""

import secrets
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

from config.env import env_secret, env_str
from deployments import services as deployment_services
from deployments.models import Node
from deployments.nodes import local_arch, local_memory_bytes
from tenants import services


class Command(BaseCommand):
    help = (
        "Create the first platform admin from TOLLGATE_ADMIN_USERNAME / TOLLGATE_ADMIN_EMAIL / "
        "TOLLGATE_ADMIN_PASSWORD(_FILE) (a one-time password is printed when none is given) "
        "and register the local Docker host as a node. Does nothing that is already done."
    )

    @transaction.atomic
    def handle(self, *args: Any, **options: Any) -> None:
        self._ensure_admin()
        self._ensure_local_node()

    def _ensure_admin(self) -> None:
        User = get_user_model()
        if User.objects.filter(is_staff=True, is_active=True).exists():
            self.stdout.write("bootstrap: a platform admin exists already")
            return
        username = env_str("TOLLGATE_ADMIN_USERNAME", "admin")
        password = env_secret("TOLLGATE_ADMIN_PASSWORD")
        generated = not password
        if generated:
            password = secrets.token_urlsafe(18)
        services.create_user(
            None,
            username=username,
            password=password,
            email=env_str("TOLLGATE_ADMIN_EMAIL", ""),
            is_staff=True,
            is_superuser=True,
            # A password printed in a log is known to whoever reads the log.
            must_change_password=generated,
        )
        self.stdout.write(f"bootstrap: created platform admin {username!r}")
        if generated:
            # Printed once so a first-time admin can log in; the console asks for a new one.
            self.stdout.write(
                f"bootstrap: one-time password for {username!r}: {password} (to be changed at the "
                "first login)"
            )

    def _ensure_local_node(self) -> None:
        name = settings.TOLLGATE_LOCAL_NODE_NAME
        if Node.objects.filter(name=name).exists():
            self.stdout.write(f"bootstrap: node {name!r} is registered already")
            return
        deployment_services.register_node(
            None,
            name=name,
            docker_url=settings.TOLLGATE_DOCKER_URL,
            arch=local_arch(),
            total_memory_bytes=local_memory_bytes(),
            engine_host=env_str("TOLLGATE_LOCAL_ENGINE_HOST", ""),
        )
        self.stdout.write(f"bootstrap: registered local node {name!r}")
