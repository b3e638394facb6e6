"""Authentication outside the gateway: admin REST API tokens (``Authorization: Bearer tga-…``)
and tenant API keys on the ``/v1`` endpoints Django serves (``/v1/usage``, ``/v1/files``,
``/v1/batches``), by the same rule as the gateway (``core.credentials``)."""

from django.contrib.auth.models import AbstractBaseUser
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from core.credentials import INVALID_KEY, presented_key, unexpired_filter
from tenants.keys import ADMIN_TOKEN, parse_key, verify_key
from tenants.models import AdminToken, ApiKey

INVALID = "Invalid or expired admin API token."


def authenticate_api_key(request: HttpRequest) -> ApiKey | None:
    """The usable tenant key the request presents (with its tenant), checked in constant time."""
    headers = request.headers
    presented = presented_key(
        headers.get("Authorization", ""), headers.get("api-key", ""), headers.get("x-api-key", "")
    )
    prefix = parse_key(presented)
    key = (
        ApiKey.objects.usable().select_related("tenant").filter(prefix=prefix).first()
        if prefix
        else None
    )
    ok = verify_key(presented, key.secret_hash if key else None)
    return key if ok else None


def invalid_key() -> HttpResponse:
    """The gateway's 401, byte for byte: every /v1 endpoint answers a bad key the same way."""
    return HttpResponse(INVALID_KEY, status=401, content_type="application/json")


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
        return (
            AdminToken.objects.select_related("user")
            .filter(prefix=prefix, revoked_at__isnull=True, user__is_active=True)
            .filter(unexpired_filter(timezone.now()))
            .first()
        )
