"""Tells every gateway process that cached state changed (Redis pub/sub).

Services call ``publish_change`` after their transaction commits; gateway processes
subscribe to ``core.keyspace.invalidation_channel()`` (gateway/runtime.py) and reload what
they cache within a second.
"""

import logging

import orjson
from django.db import transaction

from core.keyspace import invalidation_channel
from core.redis import get_redis

log = logging.getLogger(__name__)


def publish_change(kind: str, ident: object) -> None:
    """Announce after commit that a ``kind`` object (tenant, key, model, …) changed."""
    message = orjson.dumps({"kind": kind, "id": str(ident)})

    def send() -> None:
        try:
            get_redis().publish(invalidation_channel(), message)
        except Exception:  # noqa: BLE001 - caches also expire on their own schedule
            log.warning("could not publish a %s change to the gateways", kind, exc_info=True)

    transaction.on_commit(send)
