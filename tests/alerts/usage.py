"""Usage for budget tests, through the real metering path: a usage event settled into the
gateway's Redis quota counters and appended to the usage stream in one step (as
gateway/settle.lua does; tests/metering/test_reconcile.py's helper), then ingested (priced
and stored, rollups included) by metering's consumer."""

from datetime import datetime
from decimal import Decimal

from deployments.models import CatalogModel
from metering.models import Price
from tenants.models import ApiKey, Tenant
from tests.metering.conftest import drain, record
from tests.metering.test_reconcile import settle

# The price the budget tests use: 1 USD per 1M tokens, input and output alike.
TOKENS_PER_USD = 1_000_000


def spend(
    tenant: Tenant,
    model: CatalogModel,
    price: Price,
    at: datetime,
    usd: int = 0,
    tokens: int = 0,
    key: ApiKey | None = None,
    requests: int = 1,
) -> None:
    """``requests`` requests at ``at``, each of ``usd`` dollars' worth of prompt tokens (or
    ``tokens`` tokens), settled by the gateway and ingested."""
    prompt = tokens or usd * TOKENS_PER_USD
    for _ in range(requests):
        r = record(
            tenant, model, key, at=at, prompt_tokens=prompt, cached_tokens=0, completion_tokens=0
        )
        settle(tenant, r, price.cost(prompt, 0, 0))
    drain()


def usd(value: str | int) -> Decimal:
    return Decimal(str(value))
