"""Tollgate's system checks: misconfiguration reported with stable ids (``manage.py check``).

Security (``--deploy``): tollgate.W001–W009 warnings, tollgate.E001–E009 errors.
Engines: tollgate.E010–E019. Single sign-on: tollgate.E020–E029, W020–W029.
Registered by ``config.apps.TollgateConfig.ready``.
"""

from typing import Any

from django.conf import settings
from django.core.checks import Error, Warning, register

from config.env import env_secret
from core.redis import get_redis


@register(deploy=True)
def check_https(app_configs: Any, **kwargs: Any) -> list[Warning]:
    if settings.PRODUCTION and not settings.TOLLGATE_HTTPS:
        return [
            Warning(
                "Tollgate is served over plain HTTP: session cookies and API keys cross the "
                "network unencrypted.",
                hint="Put a TLS-terminating proxy in front and set TOLLGATE_HTTPS=true.",
                id="tollgate.W001",
            )
        ]
    return []


@register(deploy=True)
def check_key_pepper(app_configs: Any, **kwargs: Any) -> list[Warning]:
    # The environment, not settings: settings derive a pepper when none is given.
    if settings.PRODUCTION and not env_secret("TOLLGATE_KEY_PEPPER"):
        return [
            Warning(
                "TOLLGATE_KEY_PEPPER is not set; API-key hashes are derived from "
                "DJANGO_SECRET_KEY, so rotating that key invalidates every API key.",
                hint=(
                    "Set TOLLGATE_KEY_PEPPER (or TOLLGATE_KEY_PEPPER_FILE) to a long random value."
                ),
                id="tollgate.W002",
            )
        ]
    return []


@register(deploy=True)
def check_redis(app_configs: Any, **kwargs: Any) -> list[Error]:
    try:
        get_redis().ping()
    except Exception as exc:  # noqa: BLE001 - any failure means unreachable
        return [
            Error(
                f"Redis at REDIS_URL is unreachable ({exc.__class__.__name__}); the gateway "
                "cannot rate-limit or meter without it.",
                hint="Check REDIS_URL and that the redis service is running.",
                id="tollgate.E001",
            )
        ]
    return []


@register()
def check_engine_images(app_configs: Any, **kwargs: Any) -> list[Error]:
    if not settings.TOLLGATE_ENGINE_IMAGES:
        return [
            Error(
                "TOLLGATE_ENGINE_IMAGES is empty: no deployment could ever start.",
                hint="List allowed engine images, e.g. vllm/vllm-openai:*",
                id="tollgate.E010",
            )
        ]
    return []


@register()
def check_sso(app_configs: Any, **kwargs: Any) -> list[Error | Warning]:
    """Single sign-on settings that cannot work, or that would let nobody in."""
    from tenants.sso import parse_group_map

    issuer, client = settings.TOLLGATE_OIDC_ISSUER, settings.OIDC_RP_CLIENT_ID
    problems: list[Error | Warning] = []
    if bool(issuer) != bool(client):
        problems.append(
            Error(
                "Single sign-on is half configured: TOLLGATE_OIDC_ISSUER and "
                "TOLLGATE_OIDC_CLIENT_ID must be set together.",
                hint="Set both (and TOLLGATE_OIDC_CLIENT_SECRET), or neither.",
                id="tollgate.E020",
            )
        )
    for name in ("TOLLGATE_OIDC_MEMBER_GROUPS", "TOLLGATE_OIDC_TENANT_ADMIN_GROUPS"):
        try:
            parse_group_map(getattr(settings, name))
        except ValueError as exc:
            problems.append(
                Error(
                    f"{name}: {exc}.",
                    hint="Comma-separated groups, each a tenant slug or group=tenant-slug.",
                    id="tollgate.E021",
                )
            )
    if settings.TOLLGATE_SSO_ONLY and not settings.TOLLGATE_SSO_ENABLED:
        problems.append(
            Error(
                "TOLLGATE_SSO_ONLY is on but single sign-on is not configured: nobody "
                "but the break-glass admin could log in.",
                hint="Set TOLLGATE_OIDC_ISSUER and TOLLGATE_OIDC_CLIENT_ID, or turn SSO-only off.",
                id="tollgate.E022",
            )
        )
    if not settings.TOLLGATE_SSO_ENABLED:
        return problems
    if issuer and not issuer.startswith(("https://", "http://")):
        problems.append(
            Error(
                f"TOLLGATE_OIDC_ISSUER={issuer!r} is not an http(s) URL.",
                hint="The issuer URL, e.g. https://login.example.com/realms/main.",
                id="tollgate.E023",
            )
        )
    if not settings.OIDC_RP_CLIENT_SECRET:
        problems.append(
            Error(
                "TOLLGATE_OIDC_CLIENT_SECRET is not set; Tollgate signs in as a confidential "
                "client.",
                hint="Set TOLLGATE_OIDC_CLIENT_SECRET (or TOLLGATE_OIDC_CLIENT_SECRET_FILE).",
                id="tollgate.E024",
            )
        )
    if not (
        settings.TOLLGATE_OIDC_ADMIN_GROUPS
        or settings.TOLLGATE_OIDC_MEMBER_GROUPS
        or settings.TOLLGATE_OIDC_TENANT_ADMIN_GROUPS
    ):
        problems.append(
            Warning(
                "Single sign-on maps no group to a role: every sign-in will be refused.",
                hint="Set TOLLGATE_OIDC_ADMIN_GROUPS, TOLLGATE_OIDC_TENANT_ADMIN_GROUPS or "
                "TOLLGATE_OIDC_MEMBER_GROUPS.",
                id="tollgate.W020",
            )
        )
    if settings.TOLLGATE_SSO_ONLY and not settings.TOLLGATE_BREAK_GLASS_USERNAME:
        problems.append(
            Warning(
                "SSO-only mode without a break-glass admin: if the provider is down, "
                "nobody can log in to the console.",
                hint="Set TOLLGATE_BREAK_GLASS_USERNAME to a local platform admin.",
                id="tollgate.W021",
            )
        )
    if settings.PRODUCTION and issuer.startswith("http://"):
        problems.append(
            Warning(
                "The single sign-on provider is reached over plain HTTP.",
                hint="Use the provider's https:// issuer URL.",
                id="tollgate.W022",
            )
        )
    return problems
