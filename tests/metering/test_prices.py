"""Prices (metering/services.py): versioned, never backdated, exact to the nano-unit."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from deployments.models import CatalogModel
from metering import services as metering_services

pytestmark = pytest.mark.django_db


def test_prices_are_versioned_and_never_backdated(public_model: CatalogModel) -> None:
    start = timezone.now()
    v1 = metering_services.set_price(None, public_model, Decimal("0.20"), None, Decimal("0.60"))
    later = start + timedelta(days=30)
    v2 = metering_services.set_price(
        None, public_model, Decimal("0.10"), Decimal("0.02"), Decimal("0.30"), effective_from=later
    )
    assert v1.cached_input_per_mtok == Decimal("0.20")  # defaults to the input price
    assert metering_services.price_at(public_model, "USD", start + timedelta(days=1)) == v1
    assert metering_services.price_at(public_model, "USD", later + timedelta(seconds=1)) == v2
    assert metering_services.price_at(public_model, "EUR", later) is None
    with pytest.raises(ValidationError, match="cannot be backdated"):
        metering_services.set_price(
            None,
            public_model,
            Decimal("1"),
            None,
            Decimal("1"),
            effective_from=start - timedelta(days=1),
        )


def test_cost_is_exact_decimal_with_cached_tokens_at_the_cached_rate(
    public_model: CatalogModel,
) -> None:
    price = metering_services.set_price(
        None, public_model, Decimal("0.15"), Decimal("0.075"), Decimal("0.60")
    )
    # 1,000 prompt tokens of which 400 cached, 250 completion tokens.
    expected = (
        Decimal(600) * Decimal("0.15")
        + Decimal(400) * Decimal("0.075")
        + Decimal(250) * Decimal("0.60")
    ) / 1_000_000
    assert price.cost(1000, 400, 250) == expected == Decimal("0.00027")
