"""Typed helpers that read settings from the environment (12-factor).

Every secret may also come from a file named by ``NAME_FILE`` (Docker Compose secrets).
"""

import os
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str = "") -> str:
    """A plain string setting."""
    return os.environ.get(name, default)


def env_bool(name: str, default: bool = False) -> bool:
    """A boolean setting; anything but the usual spellings is an error, not False."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use true or false)")


def env_int(name: str, default: int) -> int:
    """An integer setting."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not an integer") from None


def env_float(name: str, default: float) -> float:
    """A floating-point setting."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number") from None


def env_list(name: str, default: list[str] | None = None) -> list[str]:
    """A comma-separated list setting; blanks are dropped."""
    raw = os.environ.get(name)
    if raw is None:
        return list(default or [])
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_secret(name: str, default: str = "") -> str:
    """A secret from ``NAME`` or from the file named by ``NAME_FILE`` (Compose secrets)."""
    path = os.environ.get(f"{name}_FILE")
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as exc:
            raise ImproperlyConfigured(f"{name}_FILE={path!r} cannot be read: {exc}") from None
    return os.environ.get(name, default)


def env_int_list(name: str, default: list[int]) -> list[int]:
    """A comma-separated list of integers (e.g. ``30,120,600``)."""
    raw = env_list(name, [str(n) for n in default])
    try:
        return [int(item) for item in raw]
    except ValueError:
        raise ImproperlyConfigured(
            f"{name}={os.environ.get(name)!r} is not a comma-separated list of integers"
        ) from None
