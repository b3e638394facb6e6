"""Admin REST API authentication with ``tga-`` tokens (``Authorization: Bearer tga-…``)."""

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Q
from django.utils import timezone
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from tenants.keys import ADMIN_TOKEN, parse_key, verify_key
from tenants.models import AdminToken

INVALID = "Invalid or expired admin API token."


class AdminTokenAuthentication(authentication.BaseAuthentication):
    """Authenticates a user by an admin API token; tenant inference keys are refused."""

    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[AbstractBaseUser, AdminToken] | None:
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer":
            return None
        presented = presented.strip()
        prefix = parse_key(presented, ADMIN_TOKEN)
        token = self._lookup(prefix) if prefix else None
        if not verify_key(presented, token.secret_hash if token else None):
            raise exceptions.AuthenticationFailed(INVALID)
        AdminToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
        return token.user, token

    def authenticate_header(self, request: Request) -> str:
        return self.keyword

    @staticmethod
    def _lookup(prefix: str) -> AdminToken | None:
        now = timezone.now()
        return (
            AdminToken.objects.select_related("user")
            .filter(prefix=prefix, revoked_at__isnull=True, user__is_active=True)
            .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
            .first()
        )
