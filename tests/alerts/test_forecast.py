"""Burn-rate forecasts checked against hand calculations: 'at the last 24 h's rate this
quota runs out on …', for money and tokens, a tenant's quota and a key's budget, and the
states without a date (no usage, already exhausted, lasts the period)."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine

from metering import forecast
from tenants import services as tenant_services
from tests.alerts.usage import spend

NOW = datetime(2026, 11, 10, 12, 0, tzinfo=UTC)


@pytest.fixture
def tenant(tenant_a):
    """100 USD and 50M tokens a month."""
    return tenant_services.update_tenant(
        None, tenant_a, quota_amount=Decimal("100"), quota_tokens=50_000_000
    )


def test_the_tenant_forecast_matches_the_hand_calculation(tenant, public_model, price) -> None:
    with time_machine.travel(NOW, tick=False):
        # 28 USD (28M tokens) five days ago, outside the window; 12 USD (12M tokens) within
        # the last 24 h, the oldest of it 23 h 59 min ago.
        spend(tenant, public_model, price, NOW - timedelta(days=5), usd=7, requests=4)
        spend(tenant, public_model, price, NOW - timedelta(hours=23, minutes=59), usd=4)
        spend(tenant, public_model, price, NOW - timedelta(hours=3), usd=4, requests=2)
        money, tokens = forecast.tenant_forecasts(tenant, NOW)
    # Money: 100 - 40 = 60 USD left at 12 USD a day: 60 / 12 = 5 days.
    assert money.used == Decimal("40") and money.rate == Decimal("12")
    assert money.state == forecast.RUNS_OUT
    assert money.runs_out_at == datetime(2026, 11, 15, 12, 0, tzinfo=UTC)
    # Tokens: 50M - 40M = 10M left at 12M a day: 10/12 of a day = 20 h.
    assert tokens.used == 40_000_000 and tokens.rate == 12_000_000
    assert tokens.runs_out_at == datetime(2026, 11, 11, 8, 0, tzinfo=UTC)
    body = money.as_dict()
    assert body["runs_out_at"] == "2026-11-15T12:00:00+00:00"
    assert body["rate_per_day"] == "12.000000000" and body["remaining"] == "60.000000000"
    assert body["summary"] == (
        "At the last 24 h's rate (12.00 USD a day) this money quota runs out on "
        "2026-11-15 12:00 UTC."
    )


def test_an_event_exactly_24_hours_old_is_outside_the_window(tenant, public_model, price) -> None:
    with time_machine.travel(NOW, tick=False):
        spend(tenant, public_model, price, NOW - timedelta(hours=24), usd=10)
        spend(tenant, public_model, price, NOW - timedelta(hours=1), usd=3)
        money, _ = forecast.tenant_forecasts(tenant, NOW)
    # 87 USD left at 3 USD a day: 29 days, past the end of November.
    assert money.rate == Decimal("3") and money.state == forecast.NOT_THIS_PERIOD
    assert money.runs_out_at is None
    assert "lasts until the period ends on 2026-12-01 00:00 UTC" in money.sentence()


def test_no_usage_in_the_last_24_hours_gives_no_date(tenant, public_model, price) -> None:
    with time_machine.travel(NOW, tick=False):
        spend(tenant, public_model, price, NOW - timedelta(days=2), usd=30)
        money, tokens = forecast.tenant_forecasts(tenant, NOW)
    assert money.used == Decimal("30") and money.state == forecast.NO_USAGE
    assert tokens.state == forecast.NO_USAGE and tokens.runs_out_at is None
    assert money.sentence() == "No usage in the last 24 h: no forecast for this money quota."


def test_an_exhausted_quota_says_so(tenant, public_model, price) -> None:
    with time_machine.travel(NOW, tick=False):
        spend(tenant, public_model, price, NOW - timedelta(hours=2), usd=101)
        money, tokens = forecast.tenant_forecasts(tenant, NOW)
    assert money.state == forecast.EXHAUSTED and money.remaining == 0
    assert tokens.state == forecast.EXHAUSTED  # 101M tokens of 50M
    assert money.sentence() == "This money quota is used up for 2026-11."


def test_no_quota_no_forecast(tenant_a) -> None:
    assert forecast.tenant_forecasts(tenant_a, NOW) == []


def test_a_key_budget_forecast_counts_the_key_and_its_children_only(
    tenant, alice, public_model, price
) -> None:
    from tenants.models import ApiKey

    key = tenant_services.issue_api_key(
        alice, tenant, name="notebook", budget_amount=Decimal("20"), budget_tokens=None
    ).key
    child = ApiKey.objects.create(
        tenant=tenant, name="batch job", prefix="childkey", secret_hash="x" * 64, parent=key
    )
    other = tenant_services.issue_api_key(alice, tenant, name="ci").key
    with time_machine.travel(NOW, tick=False):
        spend(tenant, public_model, price, NOW - timedelta(days=3), usd=4, key=key)
        spend(tenant, public_model, price, NOW - timedelta(hours=6), usd=2, key=key)
        spend(tenant, public_model, price, NOW - timedelta(hours=5), usd=2, key=child)
        spend(tenant, public_model, price, NOW - timedelta(hours=4), usd=50, key=other)
        (money,) = forecast.key_forecasts(key, NOW)
    # 20 - 8 = 12 USD left at 4 USD a day: 3 days.
    assert money.used == Decimal("8") and money.rate == Decimal("4")
    assert money.runs_out_at == datetime(2026, 11, 13, 12, 0, tzinfo=UTC)


def test_project_is_exact_to_the_microsecond() -> None:
    one_third = forecast.project("tokens", "tokens", 100, 99, 3, NOW, "monthly")
    # 1 token at 3 a day: 8 h exactly.
    assert one_third.runs_out_at == NOW + timedelta(hours=8)
    odd = forecast.project("money", "USD", Decimal("1"), Decimal("0"), Decimal("7"), NOW, "daily")
    assert odd.runs_out_at == NOW + timedelta(microseconds=86_400_000_000 // 7)
    late = forecast.project("money", "USD", Decimal("1"), Decimal("0"), Decimal("1"), NOW, "daily")
    assert late.state == forecast.NOT_THIS_PERIOD  # a day's budget at a day's rate: at midnight+
