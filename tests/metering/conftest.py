"""Helpers for metering tests: usage records as the gateway writes them, keys, prices."""

import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from decimal import Decimal
from typing import Any

import pytest

from core.keyspace import usage_stream
from core.redis import get_redis
from core.usage import FIELD, UsageRecord
from deployments.models import CatalogModel
from metering import ingest, services
from metering.models import Price
from tenants import services as tenant_services
from tenants.models import ApiKey, Tenant


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    """Argon2 is deliberately slow; these tests are about metering, not passwords."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def record(
    tenant: Tenant,
    model: CatalogModel,
    key: ApiKey | None = None,
    at: datetime | None = None,
    **fields: Any,
) -> UsageRecord:
    """One request's usage event, as the gateway would emit it."""
    base = UsageRecord(
        request_id=f"req-{uuid.uuid4().hex}",
        occurred_at=(at.timestamp() if at else datetime.now().timestamp()),
        tenant_id=tenant.pk,
        api_key_id=key.pk if key else None,
        model_id=model.pk,
        deployment_id=None,
        endpoint="chat",
        priority="P1",
        prompt_tokens=1000,
        cached_tokens=200,
        completion_tokens=300,
        reasoning_tokens=0,
        status="ok",
        http_status=200,
        latency_ms=120,
        ttft_ms=30,
        price_id=None,
    )
    return replace(base, **fields)


def emit(*records: UsageRecord) -> list[bytes]:
    """XADD each record to the usage stream, exactly as the gateway does."""
    client = get_redis()
    pipe = client.pipeline(transaction=False)
    for r in records:
        pipe.xadd(usage_stream(), {FIELD: r.encode()})
    return pipe.execute()


def drain(consumer: str = "test-consumer") -> int:
    """Ingest everything in the stream in this process."""
    return ingest.drain(consumer, seconds=30)


@pytest.fixture
def key_a(alice: Any, tenant_a: Tenant) -> ApiKey:
    return tenant_services.issue_api_key(alice, tenant_a, name="acme-prod").key


@pytest.fixture
def key_a2(alice: Any, tenant_a: Tenant) -> ApiKey:
    return tenant_services.issue_api_key(alice, tenant_a, name="acme-batch").key


@pytest.fixture
def key_b(carol: Any, tenant_b: Tenant) -> ApiKey:
    return tenant_services.issue_api_key(carol, tenant_b, name="bravo-prod").key


@pytest.fixture
def price(public_model: CatalogModel) -> Price:
    """USD 0.20 / 0.10 / 0.60 per 1M input / cached input / output tokens."""
    return services.set_price(None, public_model, Decimal("0.20"), Decimal("0.10"), Decimal("0.60"))


@pytest.fixture
def emit_many() -> Callable[..., list[UsageRecord]]:
    def make(n: int, *args: Any, **kwargs: Any) -> list[UsageRecord]:
        records = [record(*args, **kwargs) for _ in range(n)]
        emit(*records)
        return records

    return make
