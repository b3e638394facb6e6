"""Tollgate's system checks: misconfiguration reported with stable ids (``manage.py check``).

Security (``--deploy``): tollgate.W001–W009 warnings, tollgate.E001–E009 errors.
Engines: tollgate.E010–E019. Registered by ``config.apps.TollgateConfig.ready``.
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
