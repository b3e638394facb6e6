"""The one cost formula (core.pricing.cost_nano): units and rounding pinned on awkward values.

Before core/ the formula was written five times in two units: integer nano-units in the
gateway (admission estimate, settlement, orphan reaper) and exact decimals in metering (an
event's stored cost, rounded up to nine places; the FOCUS export's split, rounded half to
even). The oracles below are those decimal computations, so every caller prices exactly
as before.
"""

from decimal import ROUND_CEILING, ROUND_HALF_EVEN, Decimal

import pytest

from core.pricing import Rates, cost_nano, from_nano, to_nano

MILLION = Decimal(1_000_000)
NINE_PLACES = Decimal("1e-9")
# Prices are DecimalField(max_digits=14, decimal_places=6): the largest has 8 integer digits.
AWKWARD_PRICES = [
    Decimal("0"),
    Decimal("0.000001"),
    Decimal("0.000003"),
    Decimal("0.123457"),
    Decimal("0.15"),
    Decimal("2.5"),
    Decimal("7.777777"),
    Decimal("99999999.999999"),
]
AWKWARD_TOKENS = [0, 1, 3, 7, 999, 1_000_000, 1_234_567, 2**31 - 1]


def billed(
    price_in: Decimal,
    price_cached: Decimal,
    price_out: Decimal,
    prompt: int,
    cached: int,
    completion: int,
) -> Decimal:
    """What metering stored before: the exact decimal cost, rounded up to nine places."""
    uncached = max(prompt - cached, 0)
    exact = (uncached * price_in + cached * price_cached + completion * price_out) / MILLION
    return exact.quantize(NINE_PLACES, rounding=ROUND_CEILING)


def split_part(price: Decimal, tokens: int) -> Decimal:
    """What the FOCUS export computed before for one token kind of a line."""
    return ((tokens * price) / MILLION).quantize(NINE_PLACES, rounding=ROUND_HALF_EVEN)


@pytest.mark.parametrize(
    ("prompt", "cached", "completion", "nano"),
    [
        (1, 0, 0, 150),  # 0.15 / 1M = 0.000000150
        (1000, 400, 250, 270_000),  # 600 * 0.15 + 400 * 0.075 + 250 * 0.60 = 270 per 1M tokens
        (7, 7, 0, 525),  # all cached
        (5, 9, 0, 675),  # more cached than prompt (engines never say so): only the cached part
        (0, 0, 0, 0),
        (1_000_000, 0, 1_000_000, 750_000_000),
    ],
)
def test_cost_in_nano_units(prompt: int, cached: int, completion: int, nano: int) -> None:
    rates = Rates.of(Decimal("0.15"), Decimal("0.075"), Decimal("0.60"))
    assert cost_nano(rates, prompt, cached, completion) == nano


@pytest.mark.parametrize(
    ("prompt", "cached", "completion", "nano"),
    [
        (1, 0, 0, 1),  # 0.000001 per 1M tokens: a token costs 0.001 nano-units, billed as 1
        (999_999, 0, 0, 1),
        (1_000_001, 0, 0, 2),
        (3, 1, 1, 1),  # (2 * 1 + 1 * 7 + 1 * 13) / 1M = 0.000022: 1
        (1_000_000, 500_000, 200_000, 7),  # 0.5 + 3.5 + 2.6 = 6.6: 7
    ],
)
def test_cost_rounds_up_to_the_nano_unit(
    prompt: int, cached: int, completion: int, nano: int
) -> None:
    rates = Rates(input_nano_per_mtok=1, cached_nano_per_mtok=7, output_nano_per_mtok=13)
    assert cost_nano(rates, prompt, cached, completion) == nano


def test_cost_matches_the_decimal_billing_on_awkward_values() -> None:
    for price in AWKWARD_PRICES:
        rates = Rates.of(price, price / 2, price * 3)
        for tokens in AWKWARD_TOKENS:
            for prompt, cached, completion in (
                (tokens, 0, tokens),
                (tokens, tokens // 3, 1),
                (tokens, tokens, 0),
                (0, 0, tokens),
            ):
                expected = billed(price, price / 2, price * 3, prompt, cached, completion)
                got = cost_nano(rates, prompt, cached, completion)
                assert from_nano(got) == expected, (price, prompt, cached, completion)


def test_the_admission_estimate_is_the_cost_of_uncached_prompt_and_output() -> None:
    """Before: ceil((prompt * input + output * output_rate) / 1M) in the gateway."""
    rates = Rates.of(Decimal("0.123457"), Decimal("0.01"), Decimal("7.777777"))
    for prompt, output in ((8, 16), (1_234_567, 999), (2**31 - 1, 2**31 - 1)):
        old = -(-(prompt * 123_457_000 + output * 7_777_777_000) // 1_000_000)
        assert cost_nano(rates, prompt, 0, output) == old


def test_half_even_matches_the_exports_split() -> None:
    for price in AWKWARD_PRICES:
        rates = Rates.of(price, price, price)
        for tokens in AWKWARD_TOKENS:
            assert from_nano(cost_nano(rates, tokens, 0, 0, half_even=True)) == split_part(
                price, tokens
            )


@pytest.mark.parametrize(
    ("scaled_tokens", "nano"),
    [
        (2_500_000, 2),
        (3_500_000, 4),
        (2_500_001, 3),
        (2_499_999, 2),
        (500_000, 0),
        (1_500_000, 2),
    ],
)
def test_half_even_ties(scaled_tokens: int, nano: int) -> None:
    """One token at 1 nano per 1M tokens is 1e-6 nano: ties fall to the even nano-unit."""
    rates = Rates(input_nano_per_mtok=1, cached_nano_per_mtok=0, output_nano_per_mtok=0)
    assert cost_nano(rates, scaled_tokens, 0, 0, half_even=True) == nano
    assert cost_nano(rates, scaled_tokens, 0, 0) == -(-scaled_tokens // 1_000_000)


def test_prices_convert_to_nano_exactly_and_money_back_with_nine_places() -> None:
    assert to_nano(Decimal("99999999.999999")) == 99_999_999_999_999_000
    assert to_nano(Decimal("0.000001")) == 1000
    assert to_nano(Decimal("1e-10")) == 1  # finer than a nano-unit: up, never under-billed
    assert str(from_nano(270_000)) == "0.000270000"
    assert Rates.of(None, None, None) == Rates(0, 0, 0)
