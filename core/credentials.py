"""Credentials on ``/v1``: which key a request presents, and which keys are usable.

Both ``/v1`` doors follow this module: the gateway (``gateway.app.Gateway.authenticate``,
from its cached snapshot) and Django's key-authenticated endpoints (``/v1/usage``,
``/v1/files``, ``/v1/batches``: ``tenants.auth.authenticate_api_key``, from the database).
A refused key gets the same 401 body from both.

The usable-key rule, stated once. A key authenticates while

- neither it nor its parent (the key a key Tollgate issued for its own work acts for) is
  revoked,
- neither has expired, and
- its tenant is active.

``usable_filter`` is that rule as a database filter: ``ApiKey.objects.usable()`` and the
gateway's snapshot load keys through it. Of the rule, only expiry changes with time alone
(everything else changes by a write, and writes reload the gateway's snapshot), so the
snapshot keeps each key's earliest expiry and the gateway checks ``unexpired`` on every
request: the same comparison ``unexpired_filter`` makes in SQL.
"""

from datetime import datetime
from typing import TypeVar

import orjson
from django.db.models import Q

MAX_PRESENTED_KEY = 256  # longer is no key of ours; the cap bounds the hashing work

INVALID_KEY = orjson.dumps(
    {
        "error": {
            "message": "Incorrect API key provided. Check the key, or ask your tenant admin for a "
            "new one.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
)

Moment = TypeVar("Moment", float, datetime)


def presented_key(authorization: str, api_key: str, x_api_key: str = "") -> str:
    """The key in ``Authorization: Bearer <key>``, else in ``api-key: <key>`` (Azure-style
    clients), else in ``x-api-key: <key>`` (Anthropic-style clients); empty when there is
    none."""
    scheme, _, token = authorization.partition(" ")
    presented = token.strip() if scheme.lower() == "bearer" else ""
    return (presented or api_key.strip() or x_api_key.strip())[:MAX_PRESENTED_KEY]


def unexpired(expires_at: Moment | None, now: Moment) -> bool:
    """An expiry that has not come (None or 0: never expires)."""
    return not expires_at or expires_at > now


def unexpired_filter(now: datetime, field: str = "expires_at") -> Q:
    """``unexpired`` in SQL, for the expiry in ``field``."""
    return Q(**{f"{field}__isnull": True}) | Q(**{f"{field}__gt": now})


def usable_filter(now: datetime, tenant_active: str) -> Q:
    """Inference keys usable at ``now`` (``tenant_active``: the active tenant status)."""
    parent_live = Q(parent__revoked_at__isnull=True) & unexpired_filter(now, "parent__expires_at")
    return (
        Q(revoked_at__isnull=True)
        & unexpired_filter(now)
        & (Q(parent__isnull=True) | parent_live)
        & Q(tenant__status=tenant_active)
    )
