"""Quota counters in Redis reconciled from PostgreSQL; drift reported and corrected."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine

from core.keyspace import quota_key, usage_stream
from core.pricing import to_nano
from core.redis import get_redis
from core.usage import FIELD
from metering import ingest, reconcile
from metering.models import QuotaReconciliation, UsageEvent
from metering.periods import period_id
from tenants import services as tenant_services
from tests.metering.conftest import drain, record

NOW = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)


@pytest.fixture
def price(public_model):
    """USD 0.20 / 0.10 / 0.60 per 1M tokens, in force since before the test's clock."""
    from metering import services

    with time_machine.travel(NOW - timedelta(days=10), tick=False):
        return services.set_price(
            None, public_model, Decimal("0.20"), Decimal("0.10"), Decimal("0.60")
        )


@pytest.fixture
def quota_tenant(tenant_a):
    return tenant_services.update_tenant(
        None, tenant_a, quota_tokens=1_000_000, quota_amount=Decimal("50")
    )


def settle(tenant, r, cost: Decimal) -> None:
    """What gateway/settle.lua does at the end of a request: add to the counters and
    append the event, atomically."""
    key = quota_key(
        tenant.pk, period_id(tenant.quota_period, datetime.fromtimestamp(r.occurred_at, UTC))
    )
    pipe = get_redis().pipeline(transaction=True)
    pipe.hincrby(key, "tokens_used", r.prompt_tokens + r.completion_tokens)
    pipe.hincrby(key, "money_used", to_nano(cost))
    pipe.xadd(usage_stream(), {FIELD: r.encode()})
    pipe.execute()


def counters(tenant, at=NOW) -> dict[str, int]:
    raw = get_redis().hgetall(quota_key(tenant.pk, period_id(tenant.quota_period, at)))
    return {k.decode(): int(v) for k, v in raw.items()}


# 1000 prompt (200 cached) + 300 completion at 0.20/0.10/0.60 per 1M: 0.000360 each.
COST = Decimal("0.000360")


@time_machine.travel(NOW, tick=False)
def test_counters_that_drifted_are_corrected_and_the_drift_recorded(
    quota_tenant, key_a, public_model, price
) -> None:
    for _ in range(3):
        settle(quota_tenant, record(quota_tenant, public_model, key_a, at=NOW), COST)
    drain()
    get_redis().hincrby(quota_key(quota_tenant.pk, period_id("monthly", NOW)), "tokens_used", 5000)

    (result,) = reconcile.reconcile_all()

    assert result.status == QuotaReconciliation.Status.CORRECTED
    assert (result.tokens_redis, result.tokens_db, result.tokens_drift) == (8900, 3900, 5000)
    assert result.money_drift == 0
    assert counters(quota_tenant)["tokens_used"] == 3900
    assert counters(quota_tenant)["money_used"] == to_nano(3 * COST)


@time_machine.travel(NOW, tick=False)
def test_a_backlog_in_the_stream_is_accounted_precisely(
    quota_tenant, key_a, public_model, price
) -> None:
    ingest.ensure_group()
    for _ in range(4):
        settle(quota_tenant, record(quota_tenant, public_model, key_a, at=NOW), COST)
    drain()  # 4 stored
    for _ in range(2):  # 2 read by a consumer that has not acked them yet
        settle(quota_tenant, record(quota_tenant, public_model, key_a, at=NOW), COST)
    get_redis().xreadgroup(ingest.GROUP, "busy", {usage_stream(): ">"}, count=10)
    for _ in range(3):  # 3 not delivered yet
        settle(quota_tenant, record(quota_tenant, public_model, key_a, at=NOW), COST)
    before = counters(quota_tenant)

    (result,) = reconcile.reconcile_all()

    assert result.status == QuotaReconciliation.Status.OK
    assert result.backlog_events == 5
    assert result.tokens_db == 9 * 1300 and result.money_db == 9 * COST
    assert counters(quota_tenant) == before


@time_machine.travel(NOW, tick=False)
def test_a_stored_but_unacknowledged_event_is_not_counted_twice(
    quota_tenant, key_a, public_model, price
) -> None:
    settle(quota_tenant, record(quota_tenant, public_model, key_a, at=NOW), COST)
    ingest.ensure_group()
    entries = ingest.read_batch("crashy", block_ms=0)
    ingest.store(entries)  # committed, then the consumer died before XACK

    (result,) = reconcile.reconcile_all()

    assert result.status == QuotaReconciliation.Status.OK and result.tokens_db == 1300


@time_machine.travel(NOW, tick=False)
def test_a_backlog_over_the_cap_is_reported_as_skipped(
    quota_tenant, key_a, public_model, price, monkeypatch
) -> None:
    monkeypatch.setattr(reconcile, "BACKLOG_CAP", 2)
    for _ in range(3):
        settle(quota_tenant, record(quota_tenant, public_model, key_a, at=NOW), COST)
    get_redis().hincrby(quota_key(quota_tenant.pk, period_id("monthly", NOW)), "tokens_used", 7)

    (result,) = reconcile.reconcile_all()

    assert result.status == QuotaReconciliation.Status.SKIPPED_BACKLOG
    assert counters(quota_tenant)["tokens_used"] == 3 * 1300 + 7  # left alone


@time_machine.travel(NOW, tick=False)
def test_negative_reservations_are_reset_to_zero(quota_tenant) -> None:
    key = quota_key(quota_tenant.pk, period_id("monthly", NOW))
    get_redis().hset(key, mapping={"tokens_reserved": -40, "money_reserved": -1, "tokens_used": 0})
    reconcile.reconcile_all()
    assert counters(quota_tenant)["tokens_reserved"] == 0
    assert counters(quota_tenant)["money_reserved"] == 0


def test_at_roll_over_both_periods_end_with_the_database_numbers(
    quota_tenant, key_a, public_model, price
) -> None:
    late_nov = datetime(2026, 11, 30, 23, 59, 30, tzinfo=UTC)
    early_dec = datetime(2026, 12, 1, 0, 0, 10, tzinfo=UTC)
    with time_machine.travel(early_dec, tick=False):
        settle(quota_tenant, record(quota_tenant, public_model, key_a, at=late_nov), COST)
        settle(quota_tenant, record(quota_tenant, public_model, key_a, at=early_dec), COST)
        drain()
        # Redis lost the new month's counters (e.g. a restore from an older AOF).
        get_redis().delete(quota_key(quota_tenant.pk, period_id("monthly", early_dec)))
        get_redis().hincrby(
            quota_key(quota_tenant.pk, period_id("monthly", late_nov)), "tokens_used", 1
        )

    with time_machine.travel(early_dec + timedelta(minutes=5), tick=False):
        results = reconcile.reconcile_all()

    assert [r.period_id for r in results] == ["2026-11", "2026-12"]
    assert counters(quota_tenant, late_nov)["tokens_used"] == 1300
    assert counters(quota_tenant, early_dec)["tokens_used"] == 1300
    assert get_redis().ttl(quota_key(quota_tenant.pk, period_id("monthly", early_dec))) > 0
    assert UsageEvent.objects.count() == 2
