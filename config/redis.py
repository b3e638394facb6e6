"""One Redis client per process for counters, streams and pub/sub (not the cache)."""

from functools import cache

import redis
from django.conf import settings

from config.hot import setting


@cache
def get_redis() -> redis.Redis:
    """The process-wide Redis client (thread-safe connection pool)."""
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=2)


def rkey(*parts: object) -> str:
    """A Redis key in Tollgate's namespace: ``<prefix>:<part>:<part>…``."""
    return ":".join([setting("TOLLGATE_REDIS_PREFIX"), *map(str, parts)])
