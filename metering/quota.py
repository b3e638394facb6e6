"""Where the gateway keeps each tenant's quota consumption in Redis.

Per tenant and period there is one hash ``<prefix>:quota:<tenant_id>:<period_id>`` with
integer fields (money in nano-units of the tenant's currency, 1e-9, matching the
database's nine decimal places):

- ``tokens_used`` / ``money_used``: settled usage, added by the gateway when a request ends;
- ``tokens_reserved`` / ``money_reserved``: reservations of requests still in flight.

Admission refuses a request when used + reserved + its own reservation exceeds the quota.
The metering app reconciles ``*_used`` from PostgreSQL and reports drift.
"""

from datetime import datetime
from decimal import Decimal

from config.redis import rkey
from metering.periods import period_id

NANO = Decimal("1e9")
QUOTA_TTL_SECONDS = 40 * 24 * 3600  # outlives the longest (monthly) period


def quota_key(tenant_id: int, period: str, at: datetime) -> str:
    return rkey("quota", tenant_id, period_id(period, at))


def to_nano(amount: Decimal) -> int:
    """Money as integer nano-units for atomic Redis arithmetic (rounded up: never under-bill)."""
    return int((amount * NANO).to_integral_value(rounding="ROUND_CEILING"))


def from_nano(units: int) -> Decimal:
    return Decimal(units) / NANO
