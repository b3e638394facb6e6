"""One Redis client per process for counters, streams and pub/sub (not the cache).

Key and channel names are in ``core.keyspace``.
"""

from functools import cache

import redis
from django.conf import settings


@cache
def get_redis() -> redis.Redis:
    """The process-wide Redis client (thread-safe connection pool)."""
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=2)
