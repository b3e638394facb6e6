"""``POST /api/v1/auth/token/``: an admin API token for a username and password, so scripts
and the ``tollgate`` command line never need a browser.

Throttled twice: django-axes locks a username/address pair out after
``TOLLGATE_LOGIN_FAILURE_LIMIT`` failures (the console login's rule, shared with it), and each
address may try ``TOLLGATE_TOKEN_LOGIN_RATE`` times at all. Both answer 429 with
``Retry-After``. Every token issued is in the audit log; failures are logged by username and
address (never the password).
"""

import logging
from datetime import timedelta
from typing import Any

from axes.helpers import get_cool_off
from django.conf import settings
from django.contrib.auth import authenticate
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, serializers, status
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import AnonRateThrottle
from rest_framework.views import APIView

from core.api import Serializer
from tenants import services
from tenants.serializers import AdminTokenCreatedSerializer

log = logging.getLogger(__name__)
WRONG = "Wrong username or password, or the user is inactive."


class TokenLoginSerializer(Serializer):
    username = serializers.CharField(max_length=150)
    password = serializers.CharField(
        max_length=4096, trim_whitespace=False, style={"input_type": "password"}
    )
    name = serializers.CharField(
        max_length=100, default="command line", help_text="A label for the token."
    )
    expires_in_days = serializers.IntegerField(
        min_value=1,
        max_value=365,
        required=False,
        help_text="Lifetime in days; default TOLLGATE_TOKEN_LOGIN_DAYS (30).",
    )


class TokenLoginThrottle(AnonRateThrottle):
    """Attempts per client address, whoever they name."""

    scope = "token-login"

    def get_rate(self) -> str:
        return settings.TOLLGATE_TOKEN_LOGIN_RATE

    def get_cache_key(self, request: Request, view: APIView) -> str | None:
        # Under the stack's Redis prefix, like every key Tollgate writes.
        key = super().get_cache_key(request, view)
        return f"{settings.TOLLGATE_REDIS_PREFIX}:{key}" if key else None


class TokenLoginView(APIView):
    """Exchange a username and password for an admin API token (shown once)."""

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]
    throttle_classes = [TokenLoginThrottle]

    def get_authenticate_header(self, request: Request) -> str:
        return "Bearer"  # a 401 stays a 401 (DRF turns it into 403 without a scheme)

    @extend_schema(
        operation_id="auth_token_create",
        request=TokenLoginSerializer,
        responses={201: AdminTokenCreatedSerializer},
        auth=[],
        tags=["auth"],
    )
    def post(self, request: Request) -> Response:
        body = TokenLoginSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        django_request = request._request
        user = authenticate(django_request, username=data["username"], password=data["password"])
        if getattr(django_request, "axes_locked_out", False):
            # Answered here as a 429 problem, not by axes' middleware as the console's page.
            django_request.axes_locked_out = False
            wait = get_cool_off(django_request) or timedelta(minutes=15)
            raise exceptions.Throttled(
                wait=wait.total_seconds(), detail="Too many failed logins for this username."
            )
        if user is None or not user.is_active:
            log.warning(
                "admin token login failed for %r from %s",
                data["username"],
                django_request.META.get("REMOTE_ADDR"),
            )
            raise exceptions.AuthenticationFailed(WRONG)
        if not services.password_login_allowed(user.get_username()):
            # Single sign-on is the only way in (TOLLGATE_SSO_ONLY): a password buys no token.
            raise exceptions.PermissionDenied(
                "Local passwords are turned off: sign in to the console with single sign-on "
                "and create a token on your profile page."
            )
        if services.must_change_password(user):
            # A one-time password buys nothing but the console's password page.
            raise exceptions.PermissionDenied(
                "Set a new password first (console, /password/): this one was a one-time password."
            )
        days = data.get("expires_in_days") or settings.TOLLGATE_TOKEN_LOGIN_DAYS
        issued = services.issue_admin_token(
            user, name=data["name"], expires_at=timezone.now() + timedelta(days=days)
        )
        out = AdminTokenCreatedSerializer(issued.token).data
        out["token"] = issued.plaintext
        return Response(out, status=status.HTTP_201_CREATED)
