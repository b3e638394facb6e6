"""Batch settings, read from the environment with safe defaults.

Kept here until the lead moves them into config/settings.py; ``getattr(settings, …)``
lets a settings entry (or a test's ``settings`` fixture) override each one.
"""

from django.conf import settings

from config.env import env_float, env_int, env_str

DEFAULTS = {
    # Where the batch runner sends requests: the gateway itself, not the public URL.
    "TOLLGATE_INTERNAL_URL": lambda: env_str("TOLLGATE_INTERNAL_URL", "http://127.0.0.1:8000"),
    "TOLLGATE_BATCH_MAX_FILE_BYTES": lambda: env_int("TOLLGATE_BATCH_MAX_FILE_BYTES", 100 * 1024 * 1024),
    "TOLLGATE_BATCH_MAX_LINES": lambda: env_int("TOLLGATE_BATCH_MAX_LINES", 50_000),
    "TOLLGATE_BATCH_CONCURRENCY": lambda: env_int("TOLLGATE_BATCH_CONCURRENCY", 4),
    "TOLLGATE_BATCH_QUEUE": lambda: env_str("TOLLGATE_BATCH_QUEUE", "batches"),
    "TOLLGATE_BATCH_LEASE_SECONDS": lambda: env_int("TOLLGATE_BATCH_LEASE_SECONDS", 120),
    "TOLLGATE_BATCH_REQUEST_TIMEOUT": lambda: env_float("TOLLGATE_BATCH_REQUEST_TIMEOUT", 600.0),
    "TOLLGATE_BATCH_MAX_ATTEMPTS": lambda: env_int("TOLLGATE_BATCH_MAX_ATTEMPTS", 10),
    "TOLLGATE_BATCH_MAX_RETRY_AFTER": lambda: env_float("TOLLGATE_BATCH_MAX_RETRY_AFTER", 60.0),
    "TOLLGATE_FILES_RETENTION_DAYS": lambda: env_int("TOLLGATE_FILES_RETENTION_DAYS", 30),
}


def get(name: str):  # noqa: ANN201 - int, float or str by name
    """The setting ``name``: from Django settings if set there, else the environment."""
    if hasattr(settings, name):
        return getattr(settings, name)
    return DEFAULTS[name]()

