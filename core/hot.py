"""Settings read on the gateway's hot path, without Django's lazy-settings indirection.

Every ``settings.NAME`` goes through ``LazySettings.__getattribute__`` (a Python-level
call); the gateway reads a handful of settings per request, so it reads them here from a
plain dict instead. The cache is dropped whenever a setting changes (tests override
settings; Django sends ``setting_changed``).
"""

from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

_cache: dict[str, Any] = {}


def setting(name: str) -> Any:
    """``settings.<name>``, cached."""
    try:
        return _cache[name]
    except KeyError:
        value = _cache[name] = getattr(settings, name)
        return value


@receiver(setting_changed)
def _forget(**kwargs: Any) -> None:
    _cache.clear()
