"""Tells every gateway process that cached state changed (Redis pub/sub).

Services call ``publish_change`` after their transaction commits; gateway processes
subscribe to ``CHANNEL`` and drop or reload what changed within a second.
"""

import logging

import orjson
from django.db import transaction

from config.redis import get_redis, rkey

log = logging.getLogger(__name__)


def channel() -> str:
    return rkey("gateway", "invalidate")


def publish_change(kind: str, ident: object) -> None:
    """Announce after commit that a ``kind`` object (tenant, key, model, …) changed."""
    message = orjson.dumps({"kind": kind, "id": str(ident)})

    def send() -> None:
        try:
            get_redis().publish(channel(), message)
        except Exception:  # noqa: BLE001 - caches also expire on their own schedule
            log.warning("could not publish a %s change to the gateways", kind, exc_info=True)

    transaction.on_commit(send)
